"""Token-level access to KV pages whose inside is packed for a CPU ISA.

A page is one (block, kv-head) slice of a layer's cache: ``block_size`` tokens,
K half then V half. Kernels may pack it (the CPU ``vec`` ISA stores K
transposed), so tokens are never memcpy'd by guesswork: the layout records
where element (token, dim) of each half lives, discovered from the cache
writer itself, and moves are exact gathers and scatters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PageLayout:
    """Flat element offsets inside one page: ``k_offsets[t, d]``, ``v_offsets[t, d]``."""

    block_size: int
    head_size: int
    k_offsets: torch.Tensor
    v_offsets: torch.Tensor

    @property
    def page_elems(self) -> int:
        return 2 * self.block_size * self.head_size

    @classmethod
    def from_token_and_dim_maps(cls, token_of: torch.Tensor, dim_of: torch.Tensor) -> PageLayout:
        """Build from a probed page: element e holds (token_of[e], dim_of[e]).

        ``token_of`` and ``dim_of`` are [2 * block_size * head_size] integer
        tensors over one page (K half, then V half).
        """
        half = token_of.numel() // 2
        head_size = int(dim_of.max()) + 1
        block_size = half // head_size
        offsets = []
        for start in (0, half):
            tok, dim = token_of[start : start + half].long(), dim_of[start : start + half].long()
            where = torch.empty(block_size * head_size, dtype=torch.int64)
            where[tok * head_size + dim] = torch.arange(start, start + half, dtype=torch.int64)
            offsets.append(where.view(block_size, head_size))
        return cls(block_size, head_size, offsets[0], offsets[1])

    def _element_index(self, slots: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pages = torch.div(slots, self.block_size, rounding_mode="floor")
        return pages[:, None] * self.page_elems + offsets[slots % self.block_size]

    def gather(self, pages: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows [n, head_size] of the tokens at ``slots`` (page * block_size + offset).

        ``pages`` is the layer cache viewed flat: one-head pages, any shape whose
        storage is contiguous pages of ``page_elems`` elements.
        """
        flat = pages.reshape(-1)
        return flat[self._element_index(slots, self.k_offsets)], flat[self._element_index(slots, self.v_offsets)]

    def _affine(self, offsets: torch.Tensor) -> tuple[int, int, int] | None:
        start, token_stride, dim_stride = (
            int(offsets[0, 0]),
            int(offsets[-1, 0] - offsets[0, 0]),
            int(offsets[0, -1] - offsets[0, 0]),
        )
        token_stride //= max(self.block_size - 1, 1)
        dim_stride //= max(self.head_size - 1, 1)
        grid = start + torch.arange(self.block_size)[:, None] * token_stride + torch.arange(self.head_size) * dim_stride
        return (start, token_stride, dim_stride) if torch.equal(grid, offsets) else None

    @functools.cached_property
    def affine_keys(self) -> tuple[int, int, int] | None:
        """(offset, token stride, dim stride) when K sits at ``offset + t*ts + d*ds`` in a page (the vec ISAs
        store K transposed: strides 1 and block_size), else None."""
        return self._affine(self.k_offsets)

    @functools.cached_property
    def affine_values(self) -> tuple[int, int, int] | None:
        """The same for V (row-major after K on the vec ISAs)."""
        return self._affine(self.v_offsets)

    def page_key_blocks(self, pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """Keys of whole pages, [*page_ids.shape, block_size, head_size].

        ``page_ids``: [..., p]. One copy of the K part of each page; when the
        writer's K layout is affine the result is a strided view of that copy
        (no per-element gather), else the elements are picked out.
        """
        low, high = int(self.k_offsets.min()), int(self.k_offsets.max()) + 1
        k_part = pages.reshape(-1, self.page_elems)[:, low:high]
        picked = k_part.index_select(0, page_ids.reshape(-1)).view(*page_ids.shape, high - low)
        affine = self.affine_keys
        if affine is None:
            return picked[..., self.k_offsets.reshape(-1) - low].view(*page_ids.shape, self.block_size, self.head_size)
        start, token_stride, dim_stride = affine
        return picked.as_strided(
            (*picked.shape[:-1], self.block_size, self.head_size),
            (*picked.stride()[:-1], token_stride, dim_stride),
            picked.storage_offset() + start - low,
        )

    def page_keys(self, pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """Keys of whole pages as one sequence of tokens, [*page_ids.shape[:-1], p * block_size, head_size]."""
        return self.page_key_blocks(pages, page_ids).reshape(*page_ids.shape[:-1], -1, self.head_size)

    def scatter(self, pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V rows [n, head_size] at ``slots``, in place."""
        flat = pages.view(-1)
        flat[self._element_index(slots, self.k_offsets)] = k
        flat[self._element_index(slots, self.v_offsets)] = v
