"""Where a token's K and V lie in a paged KV cache, as plain integers a kernel can take.

kvpolicy addresses the cache as *one-head pages*: page ``p`` is KV head ``p % heads_per_block`` of vLLM block ``p //
heads_per_block``, of ``block_size`` tokens. Element (page ``p``, token ``t``, dim ``d``) of K sits in flat storage at

    (p // heads_per_block) * block_stride + (p % heads_per_block) * head_stride
        + k_offset + t * k_token_stride + d * k_dim_stride

and likewise for V: vLLM's CPU pages (K transposed in a page on the ``vec`` ISAs) and GPU caches in HND or NHD order
alike, so a kernel never assumes a layout: the caller reads it off the real cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PageGeometry:
    block_size: int
    head_size: int
    heads_per_block: int
    block_stride: int
    head_stride: int
    k_offset: int
    k_token_stride: int
    k_dim_stride: int
    v_offset: int
    v_token_stride: int
    v_dim_stride: int

    @classmethod
    def head_major(cls, cache: torch.Tensor) -> PageGeometry:
        """A cache [blocks, kv_heads, block_size, 2 * head_size] whose pages hold K then V, row-major."""
        _, heads, block_size, width = cache.shape
        head_size = width // 2
        block_stride, head_stride, token_stride, dim_stride = cache.stride()
        v_offset = head_size * dim_stride
        return cls._same_row_strides(
            block_size, head_size, heads, block_stride, head_stride, token_stride, dim_stride, v_offset
        )

    @classmethod
    def split_kv(cls, cache: torch.Tensor) -> PageGeometry:
        """A cache [blocks, 2, block_size, kv_heads, head_size] (K then V along dim 1), any strides."""
        _, _, block_size, heads, head_size = cache.shape
        block_stride, kv_stride, token_stride, head_stride, dim_stride = cache.stride()
        return cls._same_row_strides(
            block_size, head_size, heads, block_stride, head_stride, token_stride, dim_stride, kv_stride
        )

    @classmethod
    def _same_row_strides(
        cls, block_size, head_size, heads, block_stride, head_stride, token_stride, dim_stride, v_offset
    ) -> PageGeometry:
        """K at a page's start and V at ``v_offset``, both laid out with the same token and dim strides."""
        return cls(
            block_size,
            head_size,
            heads,
            block_stride,
            head_stride,
            0,
            token_stride,
            dim_stride,
            v_offset,
            token_stride,
            dim_stride,
        )

    def element_index(self, slots: torch.Tensor, value: bool = False) -> torch.Tensor:
        """Flat storage offsets of K (or V) rows at ``slots``, [n, head_size] int64: the references' gather."""
        slots = slots.long()
        page = torch.div(slots, self.block_size, rounding_mode="floor")
        token = slots % self.block_size
        block = torch.div(page, self.heads_per_block, rounding_mode="floor")
        base = block * self.block_stride + (page % self.heads_per_block) * self.head_stride
        offset, token_stride, dim_stride = (
            (self.v_offset, self.v_token_stride, self.v_dim_stride)
            if value
            else (self.k_offset, self.k_token_stride, self.k_dim_stride)
        )
        dims = torch.arange(self.head_size, device=slots.device)
        return (base + offset + token * token_stride)[:, None] + dims[None, :] * dim_stride

    def addressing(self) -> tuple[int, ...]:
        """The ints a kernel addresses pages with, in the order every kernel here takes them."""
        return (
            self.block_size,
            self.heads_per_block,
            self.block_stride,
            self.head_stride,
            self.k_offset,
            self.k_token_stride,
            self.k_dim_stride,
            self.v_offset,
            self.v_token_stride,
            self.v_dim_stride,
        )

    def key_addressing(self) -> tuple[int, ...]:
        """``addressing`` without V's three ints, for kernels that read only keys."""
        return self.addressing()[:7]


def flat(cache: torch.Tensor) -> torch.Tensor:
    """The cache's storage from its first element as a 1-D view: what element_index and the kernels address."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(cache.shape, cache.stride()))
    return cache.as_strided((span,), (1,))
