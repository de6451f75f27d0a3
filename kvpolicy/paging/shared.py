"""Pages of a request whose layers keep different amounts (PoD), laid out over every layer's pages at once.

A vLLM block spans every layer, so a layer that keeps less frees nothing unless its pages can serve other layers: page
ids are global over vLLM's one KV buffer (``BlockPages``), and any page of a block the request keeps may hold any
(layer, head). Each (layer, head) has a *main* sequence of K/V tokens: every token in a layer that keeps distant keys,
the proximal ones (sinks, recent window, generated tokens) elsewhere. A layer that shares the distant tokens' scores
keeps their values only, two per slot: distant value ``2j`` in slot ``j``'s K half, ``2j + 1`` in its V half
(``ValuePairs``). A decode step reads these pages through index tables (``DecodeTables``), one row per (request, head)
and one plane per layer, which every request keeps up to date as it grows, so a step stacks them instead of rebuilding
them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvpolicy.paging.block_pages import BlockPages
from kvpolicy.paging.page_table import TokenMoves, page_slots, stock_slots


@dataclass(frozen=True)
class ValuePairs:
    """Distant values to pack: the V of slot ``even[i]`` goes to the K half of ``dst[i]``, of ``odd[i]``
    to its V half (``odd[i] == even[i]`` pads an odd count; that half is never read)."""

    even: torch.Tensor
    odd: torch.Tensor
    dst: torch.Tensor


@dataclass(frozen=True)
class SharedLayoutPlan:
    """The moves that lay a request read in vLLM's stock layout out as ``SharedPages`` (read all, then write)."""

    tokens: TokenMoves
    values: ValuePairs


def layout_page_counts(
    keeps_distant_keys: np.ndarray, block_size: int, length: int, distant: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """[layers, heads] main tokens, and pages of packed distant values, of a layout of ``length`` tokens."""
    start, end = distant
    counts = np.where(keeps_distant_keys, length, length - (end - start))
    value_pages = np.where(keeps_distant_keys, 0, math.ceil(math.ceil((end - start) / 2) / block_size))
    return counts, value_pages


def layout_blocks(keeps_distant_keys: np.ndarray, block_size: int, length: int, distant: tuple[int, int]) -> int:
    """Blocks a layout of ``length`` tokens packs into (of its ``write_order``), plus one spare for decode
    growth: vLLM appends a block only when the request's length crosses a block boundary, heads fill earlier."""
    counts, value_pages = layout_page_counts(keeps_distant_keys, block_size, length, distant)
    needed = int((-(-counts // block_size)).sum() + value_pages.sum())
    return math.ceil(needed / keeps_distant_keys.size) + 1


class SharedPages(BlockPages):
    """Where each (layer, kv head) of one PoD request lives: main K/V pages and packed distant values."""

    def __init__(
        self,
        layer_base: Sequence[int],
        num_heads: int,
        block_size: int,
        blocks: Sequence[int],
        keeps_distant_keys: np.ndarray,
        order: Sequence[int] | None = None,
    ):
        """``keeps_distant_keys`` [layers, heads]: the (layer, head) pairs that are the lowest of their block."""
        super().__init__(layer_base, num_heads, block_size, blocks, order)
        self.keeps_keys = np.asarray(keeps_distant_keys, dtype=bool)
        self.lengths = np.zeros((self.num_layers, num_heads), dtype=np.int64)
        self.main: list[list[list[int]]] = [[[] for _ in range(num_heads)] for _ in range(self.num_layers)]
        self.values: list[list[list[int]]] = [[[] for _ in range(num_heads)] for _ in range(self.num_layers)]
        self.distant = (0, 0)  # [start, end) of the distant positions, fixed at layout
        self.keep = list(range(len(self.blocks)))  # block-table positions the layout holds
        #: ``main`` and ``values`` as arrays [layers, heads, pages] (0 past each list), for ``DecodeTables``.
        self.main_table = np.zeros((self.num_layers, num_heads, 0), dtype=np.int64)
        self.value_table = np.zeros((self.num_layers, num_heads, 0), dtype=np.int64)

    def _stock_slots(self, layer: int, head: int, positions: torch.Tensor) -> torch.Tensor:
        """Global slots of ``positions`` of one (layer, head) in vLLM's stock layout."""
        blocks = torch.tensor(self.blocks, dtype=torch.int64)
        heads = torch.tensor([head])
        return stock_slots(blocks, self.num_heads, self.block_size, positions, heads, self.layer_base[layer])[0]

    @property
    def num_distant(self) -> int:
        return self.distant[1] - self.distant[0]

    def _page_counts(self, length: int, distant: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        return layout_page_counts(self.keeps_keys, self.block_size, length, distant)

    def blocks_needed(self, length: int, distant: tuple[int, int]) -> int:
        return layout_blocks(self.keeps_keys, self.block_size, length, distant)

    def layout(self, length: int, distant: tuple[int, int]) -> SharedLayoutPlan:
        """Plan the move of ``length`` tokens in vLLM's stock layout to this layout; ``distant`` [start, end)."""
        bs = self.block_size
        start, end = distant
        self.distant = distant
        proximal = torch.cat([torch.arange(start), torch.arange(end, length)])
        pairs = math.ceil((end - start) / 2)
        counts, value_pages = self._page_counts(length, distant)
        self.keep = self.order[: self.blocks_needed(length, distant)]
        pool = [p for position in self.keep for p in self._block_pages(self.blocks[position])]
        pool.reverse()
        src, dst, even, odd, pair_dst = [], [], [], [], []
        distant_positions = torch.arange(start, end)
        for layer in range(self.num_layers):
            for h in range(self.num_heads):
                count = int(counts[layer, h])
                self.main[layer][h] = [pool.pop() for _ in range(-(-count // bs))]
                positions = torch.arange(length) if self.keeps_keys[layer, h] else proximal
                src.append(self._stock_slots(layer, h, positions))
                dst.append(page_slots(self.main[layer][h], count, bs))
                if not self.keeps_keys[layer, h] and pairs:
                    self.values[layer][h] = [pool.pop() for _ in range(int(value_pages[layer, h]))]
                    slots = self._stock_slots(layer, h, distant_positions)
                    even.append(slots[0::2])
                    odd.append(torch.cat([slots[1::2], slots[-1:]])[:pairs])
                    pair_dst.append(page_slots(self.values[layer][h], pairs, bs))
        self.free = pool
        self.lengths[:] = counts
        self.main_table = _as_table(self.main, -(-int(counts.max()) // bs) + 1)
        self.value_table = _as_table(self.values, int(value_pages.max()))
        empty = torch.zeros(0, dtype=torch.int64)
        return SharedLayoutPlan(
            TokenMoves(torch.cat(src), torch.cat(dst)),
            ValuePairs(*(torch.cat(parts) if parts else empty for parts in (even, odd, pair_dst))),
        )

    def append(self) -> torch.Tensor:
        """Room for one new token in every (layer, head)'s main sequence: its slots, [layers, heads]."""
        bs = self.block_size
        for layer, h in np.argwhere(self.lengths % bs == 0):
            if not self.free:
                raise RuntimeError("no free page left: the PoD request outgrew its blocks")
            self.main[layer][h].append(self.free.pop())
            position = len(self.main[layer][h]) - 1
            if position >= self.main_table.shape[2]:
                self.main_table = np.pad(self.main_table, ((0, 0), (0, 0), (0, position + 1)))
            self.main_table[layer, h, position] = self.main[layer][h][-1]
        pages = np.array(
            [[heads[h][n // bs] for h, n in enumerate(lengths)] for heads, lengths in zip(self.main, self.lengths)]
        )
        slots = pages * bs + self.lengths % bs
        self.lengths += 1
        return torch.from_numpy(slots)

    def main_slots(self, layer: int) -> list[torch.Tensor]:
        """Per head, the slots of its main sequence in position order."""
        return [page_slots(pages, int(n), self.block_size) for pages, n in zip(self.main[layer], self.lengths[layer])]

    def value_slots(self, layer: int, head: int) -> torch.Tensor:
        """The slots holding a sharing (layer, head)'s distant values, two per slot."""
        return page_slots(self.values[layer][head], math.ceil(self.num_distant / 2), self.block_size)

    def blocks_to_keep(self, length: int | None = None) -> set[int]:
        """The blocks the layout packed into, plus one spare for decode growth (``blocks_needed``)."""
        return set(self.keep)

    def pages_in_use(self) -> list[int]:
        return [p for table in (self.main, self.values) for layer in table for head in layer for p in head]

    def kept_tokens(self) -> int:
        """Token slots held: every main token, and one slot per pair of packed distant values."""
        pairs = math.ceil(self.num_distant / 2)
        return int(self.lengths.sum()) + pairs * int((~self.keeps_keys).sum())


def _as_table(pages: list[list[list[int]]], width: int) -> np.ndarray:
    """Per-(layer, head) page lists as an array [layers, heads, width], 0 past each list."""
    table = np.zeros((len(pages), len(pages[0]), width), dtype=np.int64)
    for layer, heads in enumerate(pages):
        for h, ids in enumerate(heads):
            table[layer, h, : len(ids)] = ids
    return table


@dataclass(frozen=True)
class DistantLogitRows:
    """Where a decode row's (layer, head) pairs store and find the distant logits a lowest layer shares.

    Each (layer, head) that some layer above reuses owns one row of a step's logits buffer per decode row:
    decode row ``r``'s pair ``k`` is row ``r * per_row + k``. ``write`` [layers, heads]: the pair index a
    (layer, head) stores its distant logits at, -1 when none reads them; ``read``: the index of the lowest
    (layer, head) of its block, -1 for a lowest layer (it attends over all its keys).
    """

    read: np.ndarray
    write: np.ndarray
    per_row: int

    @classmethod
    def of(cls, lowest: np.ndarray) -> DistantLogitRows:
        """From ``lowest`` [layers, heads]: the lowest layer of the block each (layer, head) belongs to."""
        layers, heads = lowest.shape
        own = lowest == np.arange(layers)[:, None]
        reused = np.zeros_like(own)
        reused[lowest[~own], np.nonzero(~own)[1]] = True
        write = np.full(lowest.shape, -1, dtype=np.int64)
        write[reused] = np.arange(int(reused.sum()))
        read = np.where(own, -1, write[lowest, np.arange(heads)[None, :]])
        return cls(read, write, int(reused.sum()))


@dataclass(frozen=True)
class LayerTables:
    """PoD's decode index tables, in the kernels' argument order: sequence ``r * heads + h`` is head ``h`` of
    decode row ``r``. ``DecodeTables.stacked`` holds them with one plane per layer ([layers, ...]; the distant
    positions are the same in every layer), ``DecodeTables.layer`` one layer's plane.

    ``page_table``, ``seq_lens``: each sequence's main pages and tokens (the new one included);
    ``value_table``: its packed distant values' pages; ``distant_start``/``distant_count``: its distant
    positions; ``read_from``/``write_to``: its rows of the step's distant-logits buffer (-1: none).
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    value_table: torch.Tensor
    distant_start: torch.Tensor
    distant_count: torch.Tensor
    read_from: torch.Tensor
    write_to: torch.Tensor

    def indices(self) -> tuple[torch.Tensor, ...]:
        """In the kernels' order."""
        return (self.page_table, self.seq_lens, self.value_table, self.distant_start, self.distant_count,
                self.read_from, self.write_to)  # fmt: skip


@dataclass(frozen=True)
class DecodeTables:
    """PoD's decode tables of one step, every layer (``kvpolicy_triton.pod_attention``'s arguments); the
    distant-logits buffer holds ``logit_rows`` rows of ``max_distant`` logits per query head."""

    stacked: LayerTables
    logit_rows: int
    max_distant: int

    def layer(self, index: int) -> LayerTables:
        s = self.stacked
        return replace(
            s, page_table=s.page_table[index], seq_lens=s.seq_lens[index], value_table=s.value_table[index],
            read_from=s.read_from[index], write_to=s.write_to[index],
        )  # fmt: skip

    @classmethod
    def of(cls, requests: Sequence[SharedPages], rows: DistantLogitRows) -> DecodeTables:
        layers, heads = rows.read.shape
        width = max(r.main_table.shape[2] for r in requests)
        value_width = max(1, max(r.value_table.shape[2] for r in requests))
        seqs = len(requests) * heads
        page_table = np.zeros((layers, seqs, width), dtype=np.int32)
        value_table = np.zeros((layers, seqs, value_width), dtype=np.int32)
        for i, request in enumerate(requests):
            span = slice(i * heads, (i + 1) * heads)
            page_table[:, span, : request.main_table.shape[2]] = request.main_table
            value_table[:, span, : request.value_table.shape[2]] = request.value_table
        first = np.arange(len(requests))[:, None, None] * rows.per_row  # [requests, 1, 1]

        def logit_row(index: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.where(index >= 0, first + index, -1).transpose(1, 0, 2).reshape(layers, seqs))

        stacked = LayerTables(
            page_table=torch.from_numpy(page_table),
            seq_lens=torch.from_numpy(np.concatenate([r.lengths for r in requests], axis=1).astype(np.int32)),
            value_table=torch.from_numpy(value_table),
            distant_start=torch.tensor([r.distant[0] for r in requests], dtype=torch.int32).repeat_interleave(heads),
            distant_count=torch.tensor([r.num_distant for r in requests], dtype=torch.int32).repeat_interleave(heads),
            read_from=logit_row(rows.read[None]),
            write_to=logit_row(rows.write[None]),
        )
        return cls(stacked, logit_rows=len(requests) * rows.per_row, max_distant=max(r.num_distant for r in requests))
