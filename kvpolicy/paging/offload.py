"""Pages of an OmniKV request whose sparse layers live in a separate host pool.

With ``--kv-offload`` a request keeps in vLLM's KV pool (the device): every page of its full-attention layers, one tail
page per (sparse layer, kv head) where that layer's new tokens are written, and per sparse layer the staging pages its
selected context is copied into before it attends; a page still selected at the next step stays there and is not copied
again. The completed pages of the sparse layers sit in the host pool. A vLLM block spans every layer, so this frees
blocks only when pages are shared across layers: page ids here are global over vLLM's one KV buffer (layer ``l``, block
``b``, head ``h`` is page ``layer_base[l] + b*H + h``), and a full layer's page may sit in another layer's region of a
block the request keeps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpolicy.paging.block_pages import BlockPages


class HostPagePool:
    """A pool of one-head pages outside vLLM's KV buffer (pinned memory when CUDA is present).

    A request reserves, when it is offloaded, the pages it may fill as it
    decodes up to the model's length, so a decode step never runs out.
    """

    def __init__(self, num_pages: int, page_elems: int, dtype: torch.dtype, pin: bool = False):
        self.pages = torch.empty(num_pages, page_elems, dtype=dtype, pin_memory=pin)
        self._free = list(range(num_pages - 1, -1, -1))
        self.reserved = 0

    @property
    def num_available(self) -> int:
        return len(self._free) - self.reserved

    def allocate(self, count: int, reserved: int = 0) -> list[int]:
        """``count`` pages now, and ``reserved`` more set aside for ``take_reserved``."""
        if count + reserved > self.num_available:
            raise MemoryError(f"the host pool has {self.num_available} free pages, {count + reserved} asked for")
        self.reserved += reserved
        return [self._free.pop() for _ in range(count)]

    def take_reserved(self) -> int:
        self.reserved -= 1
        return self._free.pop()

    def release(self, pages: Sequence[int], reserved: int = 0) -> None:
        self._free.extend(pages)
        self.reserved -= reserved


@dataclass(frozen=True)
class PageCopies:
    """Whole-page copies ``src[i] -> dst[i]`` (page ids; which pool each side is in, the caller knows)."""

    src: torch.Tensor
    dst: torch.Tensor

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]]) -> PageCopies:
        src, dst = zip(*pairs) if pairs else ((), ())
        return cls(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))

    @classmethod
    def cat(cls, parts: Sequence[PageCopies]) -> PageCopies:
        return cls(torch.cat([part.src for part in parts]), torch.cat([part.dst for part in parts]))

    def apply(self, source: torch.Tensor, target: torch.Tensor) -> int:
        """Copy the pages, pools viewed as [pages, page_elems]; every source is read before any
        destination is written. Returns how many pages were copied."""
        target[self.dst] = source[self.src]
        return self.src.numel()


@dataclass(frozen=True)
class OffloadPlan:
    """The copies that offload a request: sparse layers' completed pages to the host first, then the
    full layers' pages and the sparse tails into the blocks the request keeps (read all, then write)."""

    to_host: PageCopies
    on_device: PageCopies
    keep_blocks: set[int]  # block-table positions


def offload_blocks(
    full_layers: Sequence[bool], num_heads: int, block_size: int, length: int, staging_pages: int
) -> int:
    """Blocks (of its ``write_order``) an offload of ``length`` tokens keeps: every full layer's pages, a
    tail page and ``staging_pages`` per sparse (layer, head), packed over every layer of a block, and one
    spare for decode growth."""
    num_sparse = list(full_layers).count(False)
    num_layers = len(full_layers)
    pages = num_heads * ((num_layers - num_sparse) * math.ceil(length / block_size) + num_sparse * (1 + staging_pages))
    return math.ceil(pages / (num_layers * num_heads)) + 1


@dataclass(frozen=True)
class SparseCall:
    """One sparse layer's view of a request: load ``loads.src`` (host) into ``loads.dst`` (device),
    then each head attends to ``table[h]`` (staging pages, then its tail page) up to ``seq_len``."""

    loads: PageCopies
    table: list[list[int]]
    seq_len: int


class OffloadedRequest(BlockPages):
    """Where each (layer, kv head) of one request lives once its sparse layers are offloaded."""

    def __init__(
        self,
        layer_base: Sequence[int],
        num_heads: int,
        block_size: int,
        blocks: Sequence[int],
        full_layers: Sequence[bool],
        order: Sequence[int] | None = None,
    ):
        super().__init__(layer_base, num_heads, block_size, blocks, order)
        self.full = list(full_layers)
        self.length = 0
        self.pages: list[list[list[int]]] = []  # full layers: every page; sparse layers: [tail page]
        self.host_pages: list[list[list[int]]] = []  # sparse layers: completed pages, in position order
        self.staging: list[list[list[int]]] = []  # sparse layers: [head][slot] device pages
        self.staged: list[list[int]] = []  # sparse layers: [slot] the context page index staged there, or -1
        self.host_reserved = 0

    def offload(self, length: int, host: HostPagePool, staging_pages: int, max_length: int) -> OffloadPlan:
        """Plan the move of a request read in vLLM's stock layout (``length`` tokens) to the offloaded one.

        ``staging_pages``: completed pages a sparse layer may attend to per head (its budget in pages,
        less the current one). Raises MemoryError, changing nothing, when the host pool cannot take
        the request up to ``max_length`` tokens.
        """
        bs, heads = self.block_size, self.num_heads
        num_pages = math.ceil(length / bs)
        sparse = [layer for layer in range(self.num_layers) if not self.full[layer]]
        if self.blocks_needed(length, staging_pages) > len(self.order):
            raise ValueError(f"the offloaded request needs more blocks than the {len(self.order)} it may write")
        now = len(sparse) * heads * (num_pages - 1)
        growth = len(sparse) * heads * (math.ceil(max_length / bs) - 1) - now
        host_ids = iter(host.allocate(now, reserved=growth))
        self.host_reserved = growth
        to_host = []
        self.host_pages = [[[] for _ in range(heads)] for _ in range(self.num_layers)]
        for layer in sparse:
            for h in range(heads):
                for i in range(num_pages - 1):
                    page = next(host_ids)
                    to_host.append((self._page(layer, self.blocks[i], h), page))
                    self.host_pages[layer][h].append(page)
        keep = self.order[: self.blocks_needed(length, staging_pages)]
        staying = {
            self._page(layer, self.blocks[i], h)
            for layer in range(self.num_layers)
            if self.full[layer]
            for h in range(heads)
            for i in keep
            if i < num_pages
        }
        free = [p for i in keep for p in self._block_pages(self.blocks[i]) if p not in staying]
        free.reverse()
        on_device = []
        self.pages = [[[] for _ in range(heads)] for _ in range(self.num_layers)]
        for layer in range(self.num_layers):
            for h in range(heads):
                if self.full[layer]:
                    for i in range(num_pages):
                        page = self._page(layer, self.blocks[i], h)
                        if page not in staying:
                            on_device.append((page, free.pop()))
                            page = on_device[-1][1]
                        self.pages[layer][h].append(page)
                else:
                    tail = free.pop()
                    on_device.append((self._page(layer, self.blocks[num_pages - 1], h), tail))
                    self.pages[layer][h].append(tail)
        self.free = free
        self.length = length
        self.staging = [[[] for _ in range(heads)] for _ in range(self.num_layers)]
        self.staged = [[] for _ in range(self.num_layers)]
        for layer in sparse:
            self._grow_staging(layer, staging_pages)
        return OffloadPlan(PageCopies.of(to_host), PageCopies.of(on_device), set(keep))

    def blocks_needed(self, length: int, staging_pages: int) -> int:
        """``offload_blocks``, capped by the request's blocks: vLLM appends more as it grows."""
        return min(offload_blocks(self.full, self.num_heads, self.block_size, length, staging_pages), len(self.blocks))

    def _grow_staging(self, layer: int, count: int) -> None:
        missing = count - len(self.staged[layer])
        if missing <= 0:
            return
        if missing * self.num_heads > len(self.free):
            raise RuntimeError("no free page left for staging: the offloaded request outgrew its blocks")
        for staging in self.staging[layer]:
            staging.extend(self.free.pop() for _ in range(missing))
        self.staged[layer].extend([-1] * missing)

    def append(self, host: HostPagePool) -> tuple[torch.Tensor, list[PageCopies]]:
        """Room for one new token in every (layer, head): its slots [layers, heads], and per layer the
        full tail pages to copy to the host before the token is written (they start a new page)."""
        bs, heads = self.block_size, self.num_heads
        offset = self.length % bs
        slots = torch.empty(self.num_layers, heads, dtype=torch.int64)
        flushes = []
        for layer in range(self.num_layers):
            copies = []
            for h in range(heads):
                pages = self.pages[layer][h]
                if self.full[layer]:
                    if offset == 0:
                        if not self.free:
                            raise RuntimeError("no free page left: the offloaded request outgrew its blocks")
                        pages.append(self.free.pop())
                    page = pages[self.length // bs]
                else:
                    page = pages[0]
                    if offset == 0:
                        host_page = host.take_reserved()
                        self.host_reserved -= 1
                        copies.append((page, host_page))
                        self.host_pages[layer][h].append(host_page)
                slots[layer, h] = page * bs + offset
            flushes.append(PageCopies.of(copies))
        self.length += 1
        return slots, flushes

    def full_table(self, layer: int) -> list[list[int]]:
        """Per head, the pages a full-attention layer reads, in position order."""
        return self.pages[layer]

    def sparse_call(self, layer: int, chosen: Sequence[int]) -> SparseCall:
        """What a sparse layer reads: the selected page indices ``chosen`` (ascending, the current page
        last). Completed pages already staged for this layer are reused; the others replace pages
        no longer selected."""
        completed = list(chosen[:-1])
        self._grow_staging(layer, len(completed))
        staged = self.staged[layer]
        wanted = set(completed)
        slot_of = {index: slot for slot, index in enumerate(staged) if index in wanted}
        open_slots = [slot for slot, index in enumerate(staged) if index not in wanted]
        staging = self.staging[layer]
        loads = []
        for index in completed:
            if index not in slot_of:
                slot = open_slots.pop()
                staged[slot] = index
                slot_of[index] = slot
                loads.extend((self.host_pages[layer][h][index], staging[h][slot]) for h in range(self.num_heads))
        table = [
            [*(staging[h][slot_of[index]] for index in completed), self.pages[layer][h][0]]
            for h in range(self.num_heads)
        ]
        current = self.length - (math.ceil(self.length / self.block_size) - 1) * self.block_size
        return SparseCall(PageCopies.of(loads), table, len(completed) * self.block_size + current)

    def pages_in_use(self) -> list[int]:
        return [p for tables in (self.pages, self.staging) for layer in tables for head in layer for p in head]

    def host_page_ids(self) -> list[int]:
        return [p for layer in self.host_pages for head in layer for p in head]
