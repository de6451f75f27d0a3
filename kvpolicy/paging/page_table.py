"""Page tables of one request: which pages each (layer, kv head) reads, and how long it is.

vLLM gives a request whole blocks; one block id covers every layer and every KV head. Viewing a layer's cache as
one-head pages, block ``b`` holds pages ``b*H .. b*H+H-1`` and any of them may serve any head of that request. A
relocated request packs each layer's kept tokens densely, head after head, into the pages of its first writable blocks,
so the others are the ones a compressing policy can hand back. With ``layer_base`` (vLLM's whole KV buffer as one page
space, the CPU layout) the pages of every layer of a block form one pool: after the step's last layer, ``pack`` moves
pages out of the blocks past the fewest that hold them all, so a layer that keeps more than the others borrows their
pages instead of setting the block count of all. With prefix caching the blocks others read are never written, and
those still cached are written last (``write_order``), so a shared prefix keeps as many cached blocks as it can.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvpolicy.paging.block_pages import drop_blocks
from kvpolicy.paging.page_store import PageStore


def stock_slots(
    blocks: torch.Tensor,
    num_heads: int,
    block_size: int,
    positions: torch.Tensor,
    heads: torch.Tensor,
    first_page: int = 0,
) -> torch.Tensor:
    """[heads, positions] one-head slots of a request's tokens in vLLM's stock layout: token i of
    head h in page ``first_page + blocks[i // block_size] * num_heads + h`` (``first_page``: the
    layer's first page when pages index vLLM's whole KV buffer)."""
    pages = blocks[torch.div(positions, block_size, rounding_mode="floor")].long()[None, :] * num_heads
    return (first_page + pages + heads[:, None]) * block_size + positions % block_size


def stock_page_tables(block_table: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[rows * num_heads, width] one-head page tables of rows in vLLM's stock layout, ordered (row, head):
    row r's head h reads pages ``block_table[r] * num_heads + h``."""
    rows, width = block_table.shape
    heads = torch.arange(num_heads, device=block_table.device)
    return (block_table.long()[:, None, :] * num_heads + heads[None, :, None]).reshape(rows * num_heads, width)


def page_slots(pages: Sequence[int], count: int, block_size: int) -> torch.Tensor:
    """One-head slots of the first ``count`` tokens written densely over ``pages``."""
    positions = torch.arange(count)
    return torch.tensor(pages, dtype=torch.int64)[positions // block_size] * block_size + positions % block_size


def write_order(num_blocks: int, shared: Sequence[int] = (), cached: Sequence[int] = ()) -> list[int]:
    """Block-table positions relocation may write, in the order to fill them: blocks only this
    request knows first, then its blocks in the prefix cache from the last back (a later prompt
    sharing a prefix hits its first blocks); never ``shared`` ones, which other requests read."""
    skip, last = set(shared), set(cached)
    own = [p for p in range(num_blocks) if p not in skip and p not in last]
    return own + sorted(last - skip, reverse=True)


def relocation_blocks(entries: int, num_heads: int, block_size: int) -> int:
    """The most blocks, of a request's ``write_order``, a relocation writes and keeps when its fullest
    layer holds ``entries`` (token, head) entries: their pages, each head's last one part-filled, and a
    block spare for decode growth (``RequestPages.blocks_to_keep``)."""
    pages = -(-entries // block_size) + num_heads
    return -(-pages // num_heads) + 1


@dataclass(frozen=True)
class TokenMoves:
    """One layer's relocation: the token at ``src[i]`` moves to ``dst[i]``.

    Both are one-head page slots (``page * block_size + offset``). Sources and
    destinations may overlap, so movers read every source before writing.
    """

    src: torch.Tensor
    dst: torch.Tensor


class RequestPages:
    """Per-(layer, kv head) pages and physical lengths of one request: a row of a ``PageStore``.

    What changes at every step (lengths, page tables, free pages) lives in the
    store's batch-wide arrays, so a step appends to every request at once
    (``PageStore.append``); what changes only at relocation and release (the
    blocks, the write order) lives here.
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        block_size: int,
        blocks: Sequence[int],
        order: Sequence[int] | None = None,
        layer_base: Sequence[int] | None = None,
        store: PageStore | None = None,
    ):
        """``order``: the block-table positions relocation may write, in the order it fills them
        (``write_order``); by default every block, in table order. ``layer_base``: each layer's first
        page in vLLM's whole KV buffer: page ids then index that buffer and every layer draws on one
        pool; None: they index the layer's own cache and each layer has its own. ``store``: the
        worker's rows of relocated requests (a store of its own by default)."""
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.block_size = block_size
        self.pools_layers = layer_base is not None
        if store is None:
            store = PageStore(num_layers, num_heads, block_size, self.pools_layers, rows=1)
        shape = (store.num_layers, store.num_heads, store.block_size, store.pools_layers)
        if shape != (num_layers, num_heads, block_size, self.pools_layers):
            raise ValueError(f"a request of shape {(num_layers, num_heads, block_size)} in a store of {shape[:3]}")
        self.store = store
        self.row = store.add(self)  # the store moves it (``PageStore.arrange``)
        self.layer_base = np.asarray(list(layer_base) if self.pools_layers else [0] * num_layers, dtype=np.int64)
        self.blocks: list[int | None] = []  # by vLLM block-table position; None once released
        self._keys: list[dict[int, int] | None] = [None] * store.num_pools  # ``_write_keys``; None once blocks change
        self.relocated = [False] * num_layers
        self.order: list[int] = list(range(len(blocks)) if order is None else order)
        self.add_blocks(blocks, writable=False)

    def close(self) -> None:
        """Hand the request's row of the store back."""
        self.store.remove(self.row)

    @property
    def lengths(self) -> np.ndarray:
        """[layers, heads] tokens each head holds (a view of the store's row)."""
        return self.store.lengths[:, self.row]

    @property
    def head_pages(self) -> list[list[list[int]]]:
        """[layer][head] the pages each head reads, in order."""
        row = self.row
        return [
            [self.store.head_pages(layer, row, h) for h in range(self.num_heads)] for layer in range(self.num_layers)
        ]

    @property
    def free(self) -> list[list[int]]:
        """By pool: the pages no head holds yet, in the order heads take them."""
        return [self.store.free_pages(pool, self.row) for pool in range(self.store.num_pools)]

    def _pool(self, layer: int) -> int:
        return self.store.pool(layer)

    def _pool_layers(self, pool: int) -> range:
        return range(self.num_layers) if self.pools_layers else range(pool, pool + 1)

    def _layer_pages(self, layer: int, block: int) -> list[int]:
        first = int(self.layer_base[layer]) + block * self.num_heads
        return list(range(first, first + self.num_heads))

    def _pages_of(self, block: int, pool: int) -> list[int]:
        """The pages of ``block`` in ``pool``: its part of one layer's cache, or of every layer's."""
        return [p for layer in self._pool_layers(pool) for p in self._layer_pages(layer, block)]

    def add_blocks(self, blocks: Sequence[int], writable: bool = True) -> None:
        """Blocks vLLM appended to the request: new, so writable and their pages free in every pool (the
        prompt's blocks, added at construction, are not: they hold its tokens and ``order`` says which to write)."""
        if writable and len(blocks):
            RequestPages.add_new_blocks([self], np.asarray(blocks, dtype=np.int64)[None, :])
            return
        self.blocks.extend(int(block) for block in blocks)
        self._keys = [None] * self.store.num_pools

    @staticmethod
    def add_new_blocks(requests: Sequence[RequestPages], blocks: np.ndarray) -> None:
        """``add_blocks(blocks[i])`` for each of ``requests`` (rows of one store; ``blocks`` [requests, n]),
        their free pages added to the store in one call: when a batch's requests cross a block boundary in
        the same step, one per request cost milliseconds."""
        store, heads = requests[0].store, requests[0].num_heads
        count = blocks.shape[1]
        for request, new in zip(requests, blocks.tolist()):
            if request.store is not store:
                raise ValueError("requests of different page stores")
            request.order.extend(range(len(request.blocks), len(request.blocks) + count))
            request.blocks.extend(new)
            request._keys = [None] * store.num_pools
        pages = (blocks * heads)[:, None, :, None] + np.arange(heads)  # [requests, 1, blocks, heads]
        if store.pools_layers:  # one pool: each layer's pages from its base, in (block, layer, head) order
            pages = np.stack([request.layer_base for request in requests])[:, :, None, None] + pages
            by_pool = pages.transpose(0, 2, 1, 3).reshape(1, len(requests), -1)
        else:  # a pool per layer, of the layer's own cache: the same pages in each
            by_pool = np.broadcast_to(
                pages.reshape(1, len(requests), -1), (store.num_layers, len(requests), count * heads)
            )
        rows = np.fromiter((request.row for request in requests), dtype=np.int64, count=len(requests))
        store.extend_free(rows, by_pool)

    def _live_order(self) -> list[int]:
        """Block-table positions relocation may write and not yet released, in the order it fills them."""
        return [pos for pos in self.order if self.blocks[pos] is not None]

    def _per_block(self, pool: int) -> int:
        return len(self._pool_layers(pool)) * self.num_heads

    def _write_keys(self, pool: int) -> dict[int, int]:
        """Each writable page of ``pool``: its place in the write order (its block's, then its own within the
        block), made once until the request's blocks change: every layer's relocation sorts by it."""
        if self._keys[pool] is None:
            per_block = self._per_block(pool)
            self._keys[pool] = {
                p: i * per_block + j
                for i, pos in enumerate(self._live_order())
                for j, p in enumerate(self._pages_of(self.blocks[pos], pool))
            }
        return self._keys[pool]

    def _held(self, layer: int) -> list[int]:
        """Pages a layer's tokens occupy: before its first relocation its part of every block."""
        if self.relocated[layer]:
            return self._relocated_pages(layer)
        return [p for block in self.blocks if block is not None for p in self._layer_pages(layer, block)]

    def _relocated_pages(self, layer: int) -> list[int]:
        """The pages a layer's heads hold in its per-head tables (none before its first relocation)."""
        return [p for h in range(self.num_heads) for p in self.store.head_pages(layer, self.row, h)]

    def _stock_slots(self, layer: int, head: int, positions: torch.Tensor) -> torch.Tensor:
        blocks = torch.tensor(self.blocks, dtype=torch.int64)
        heads = torch.tensor([head])
        return stock_slots(blocks, self.num_heads, self.block_size, positions, heads, int(self.layer_base[layer]))[0]

    def _head_slots(self, layer: int, head: int, positions: torch.Tensor) -> torch.Tensor:
        pages = torch.tensor(self.store.head_pages(layer, self.row, head), dtype=torch.int64)
        return pages[torch.div(positions, self.block_size, rounding_mode="floor")] * self.block_size + (
            positions % self.block_size
        )

    def current_slots(self, layer: int, positions: Sequence[torch.Tensor]) -> torch.Tensor:
        """Where ``positions[h]`` (indices into head h's current sequence) sit now, concatenated.

        Before a layer's first relocation its tokens sit in vLLM's stock layout
        (token i of head h in page ``blocks[i // bs] * H + h``).
        """
        slot_of = self._head_slots if self.relocated[layer] else self._stock_slots
        return torch.cat([slot_of(layer, h, p.to(torch.int64)) for h, p in enumerate(positions)])

    def relocate(self, layer: int, keep: Sequence[torch.Tensor]) -> TokenMoves:
        """Keep ``keep[h]`` (indices into head h's current sequence), packed densely from the first page.

        The layer writes the pages it holds and the free ones of its pool, in
        write order; the moves read every source before writing.
        """
        src = self.current_slots(layer, keep)
        return TokenMoves(src, self.allot(layer, [int(kept.numel()) for kept in keep]))

    def allot(self, layer: int, counts: Sequence[int]) -> torch.Tensor:
        """``relocate``'s destinations alone: head h's new sequence is ``counts[h]`` tokens packed densely
        from its first page; their slots, concatenated. A caller that holds the kept indices where the cache
        is takes the sources from ``current_slots`` of every token, read before this call."""
        pool_id = self._pool(layer)
        keys = self._write_keys(pool_id)
        free = self.store.free_pages(pool_id, self.row)
        candidates = set(self._held(layer)).union(free).intersection(keys)
        pool = sorted(candidates, key=keys.__getitem__)
        needed = [math.ceil(n / self.block_size) for n in counts]
        if sum(needed) > len(pool):
            raise ValueError(
                f"layer {layer} keeps more tokens than the request's {len(self.order)} writable blocks hold"
            )
        dst, cursor = [], 0
        for head, (n, n_pages) in enumerate(zip(counts, needed)):
            self.store.set_head_pages(layer, self.row, head, pool[cursor : cursor + n_pages])
            self.store.lengths[layer, self.row, head] = n
            cursor += n_pages
            dst.append(self._head_slots(layer, head, torch.arange(n, dtype=torch.int64)))
        self.store.set_free(pool_id, self.row, pool[cursor:])
        self.relocated[layer] = True
        return torch.cat(dst)

    def append(self, count: int = 1) -> np.ndarray:
        """Room for ``count`` new tokens in every (layer, head); returns their slots, [layers, count, heads].
        A step of many requests appends to them all at once (``PageStore.append``)."""
        slots = self.store.append(np.array([self.row]), np.array([count]))
        return slots.reshape(self.num_layers, self.num_heads, count).transpose(0, 2, 1)

    def pack(self) -> TokenMoves:
        """With one pool for every layer: move the pages held in blocks past the fewest that hold them
        all into free pages of those blocks (whole pages), so ``blocks_to_keep`` can hand back the rest.

        Runs after the step's last layer, when no layer reads its stock layout
        any more; destinations are free, so no move overwrites a source.
        """
        if not (self.pools_layers and all(self.relocated)):
            raise RuntimeError("pack needs pages pooled across layers (layer_base), every layer relocated")
        keys = self._write_keys(0)
        head_pages = self.head_pages
        held = [
            (layer, head, i, page)
            for layer in range(self.num_layers)
            for head in range(self.num_heads)
            for i, page in enumerate(head_pages[layer][head])
        ]
        per_block = self._per_block(0)
        end = math.ceil(len(held) / per_block) * per_block  # the keys of the pages of the fewest blocks
        free = self.free[0]
        holes = iter(p for p in free if keys[p] < end)
        src, dst, changed = [], [], set()
        for layer, head, i, page in held:
            if keys[page] >= end:
                hole = next(holes)
                head_pages[layer][head][i] = hole
                changed.add((layer, head))
                src.append(page)
                dst.append(hole)
        if dst:
            for layer, head in changed:
                self.store.set_head_pages(layer, self.row, head, head_pages[layer][head])
            filled = set(dst)
            self.store.set_free(0, self.row, sorted([p for p in free if p not in filled] + src, key=keys.__getitem__))
        whole = len(src) * self.block_size
        return TokenMoves(page_slots(src, whole, self.block_size), page_slots(dst, whole, self.block_size))

    def blocks_to_keep(self, length: int | None = None) -> set[int]:
        """Block-table positions to hold after relocation: the fullest pool's pages and its spare ones.

        Pages are packed in ``order`` (after ``pack`` when layers share a pool), so a pool that needs ``p`` pages needs
        the first ``ceil(p / P)`` blocks of it, ``P`` its pages per block (H, or every layer's H). vLLM appends a block
        each time the request's ``length`` reaches a multiple of ``block_size``, but heads reach a page boundary at
        their own steps: until the next append, every head that fills its last page first takes a spare one. Each head
        fills at most one page per block appended, so those spares cover the request from then on. While a prompt is
        still read a chunk at a time (``length`` None), one whole block is spare.
        """
        counts = self._page_counts().astype(np.int64)
        if length is None:
            pages = counts.sum(axis=1) + self.num_heads
        else:
            before_next_block = -length % self.block_size
            pages = counts.sum(axis=1) + (-self.lengths % self.block_size < before_next_block).sum(axis=1)
        if self.pools_layers:
            pages = pages.sum(keepdims=True)
        return set(self._live_order()[: math.ceil(int(pages.max()) / self._per_block(0))])

    def release_except(self, keep: set[int]) -> int:
        """Stop using every block-table position not in ``keep``; returns how many were live."""
        dropped = drop_blocks(self.blocks, keep)
        self._keys = [None] * self.store.num_pools
        for pool, free in enumerate(self.free):
            gone = {p for block in dropped for p in self._pages_of(block, pool)}
            for layer in self._pool_layers(pool):
                if not gone.isdisjoint(self._relocated_pages(layer)):
                    raise RuntimeError(f"a released block still holds pages of layer {layer}")
            self.store.set_free(pool, self.row, [p for p in free if p not in gone])
        return len(dropped)

    def live_blocks(self) -> int:
        """Blocks the request holds now (released ones excluded)."""
        return sum(block is not None for block in self.blocks)

    def kept_tokens(self) -> int:
        return int(self.lengths.sum())

    def _page_counts(self) -> np.ndarray:
        """[layers, heads] pages each head holds."""
        return self.store.counts[:, self.row]
