"""Page tables, lengths and free pages of every relocated request of a worker, one row each of batch-wide arrays.

A decode step appends a token to every (layer, KV head) of every relocated request. Kept in one Python object per
request, that is a loop over the batch on the host at every step, and the step's page tables are copied out of those
objects. Here a request is a row of arrays shared by the whole batch: ``arrange`` puts the step's rows first, in the
step's order, ``append`` gives them all room for their new tokens with a few numpy operations, and each layer's
attention call reads its page table as a view of those first rows. A copy of the tables elsewhere (the GPU's) follows
by the changes listed since it last synced (``take_changes``): whole rows that moved or were rewritten and single
entries the appends wrote, not the tables themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def virtual_tokens(counts: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of ``counts[i]`` tokens each as ``heads`` one-head sequences apiece, ordered (row, head, token):
    each virtual token's row, head and token within its row, as three arrays."""
    per_row = heads * counts
    row = np.repeat(np.arange(len(counts)), per_row)
    within = np.arange(row.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    return row, within // counts[row], within % counts[row]


@dataclass
class StoreChanges:
    """What changed in ``PageStore.tables`` since the last ``take_changes``: ``resized`` (its shape changed: a
    copy must take it whole), the rows rewritten or moved, and entries written one by one (flat indices, values)."""

    resized: bool = True
    rows: set[int] = field(default_factory=set)
    flat: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)


#: ``PageStore``'s arrays with a part per row, each on its axis 1 (the tables' with ``heads`` entries per row).
ROW_ARRAYS = ("lengths", "counts", "page_starts", "tables", "free", "free_start", "free_end")


class PageStore:
    """Rows of per-(layer, head) page tables over pools of free pages, for requests of one model shape.

    ``tables`` [layers, rows * heads, width] int32: row ``r``'s head ``h`` reads
    the pages at ``tables[l, r*heads + h, :counts[l, r, h]]`` (zeros after
    them); ``lengths`` [layers, rows, heads] its tokens. Free pages are kept per
    pool, one per layer or one for every layer (``pools_layers``), as
    ``free[pool, row, free_start:free_end]``, taken from the front.
    """

    def __init__(self, num_layers: int, num_heads: int, block_size: int, pools_layers: bool, rows: int = 4):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.block_size = block_size
        self.pools_layers = pools_layers
        self.num_pools = 1 if pools_layers else num_layers
        self.lengths = np.zeros((num_layers, rows, num_heads), dtype=np.int32)
        self.counts = np.zeros((num_layers, rows, num_heads), dtype=np.int32)
        # each head's last page as its first slot (page * block_size, 0 without pages): a decode step's slots
        # are then one addition
        self.page_starts = np.zeros((num_layers, rows, num_heads), dtype=np.int64)
        self.tables = np.zeros((num_layers, rows * num_heads, 4), dtype=np.int32)
        self.free = np.zeros((self.num_pools, rows, 4 * num_heads), dtype=np.int32)
        self.free_start = np.zeros((self.num_pools, rows), dtype=np.int64)
        self.free_end = np.zeros((self.num_pools, rows), dtype=np.int64)
        self.owners: list[object | None] = [None] * rows
        self.changes = StoreChanges()

    @property
    def num_rows(self) -> int:
        return len(self.owners)

    @property
    def width(self) -> int:
        return self.tables.shape[2]

    def pool(self, layer: int) -> int:
        return 0 if self.pools_layers else layer

    def table_of(self, layer: int, row: int) -> np.ndarray:
        """Row ``row``'s page table in ``layer``, [heads, width] (a view)."""
        return self.tables[layer, row * self.num_heads : (row + 1) * self.num_heads]

    # Rows.

    def add(self, owner: object) -> int:
        """A row for ``owner``, empty; grows the arrays when every row is taken."""
        if None not in self.owners:
            self._grow_rows(2 * self.num_rows)
        row = self.owners.index(None)
        self.owners[row] = owner
        for array in self._by_row():
            array[:, row] = 0
        self.changes.rows.add(row)
        return row

    def remove(self, row: int) -> None:
        self.owners[row] = None

    def _by_row(self) -> list[np.ndarray]:
        """Views of every array in ``ROW_ARRAYS`` as [part, rows, rest]: what a row holds is ``[:, row]``."""
        return [getattr(self, name).reshape(getattr(self, name).shape[0], self.num_rows, -1) for name in ROW_ARRAYS]

    def table_of_rows(self, row: int) -> np.ndarray:
        """Every layer's page table of ``row``, [layers, heads, width] (a view)."""
        return self.tables.reshape(self.num_layers, self.num_rows, self.num_heads, -1)[:, row]

    def arrange(self, owners: list) -> None:
        """Move ``owners``' rows to the first ``len(owners)``, in that order (each owner's ``row`` follows);
        other rows keep their order after them. Steps in the same order as the last one move nothing."""
        current = np.fromiter((owner.row for owner in owners), dtype=np.int64, count=len(owners))
        if np.array_equal(current, np.arange(len(owners))):
            return
        placed = np.zeros(self.num_rows, dtype=bool)
        placed[current] = True
        order = np.concatenate([current, np.flatnonzero(~placed)])  # new row i is old row order[i]
        moved = np.flatnonzero(order != np.arange(self.num_rows))
        source = order[moved]
        for array in self._by_row():
            array[:, moved] = array[:, source]
        owners_before = self.owners
        self.owners = [owners_before[i] for i in order]
        for row in moved:
            owner = self.owners[row]
            if owner is not None:
                owner.row = int(row)
        self.changes.rows.update(moved.tolist())

    # Pages of one row (relocation, release: once per request and layer, not per step).

    def head_pages(self, layer: int, row: int, head: int) -> list[int]:
        return self.table_of(layer, row)[head, : self.counts[layer, row, head]].tolist()

    def set_head_pages(self, layer: int, row: int, head: int, pages: list[int]) -> None:
        if len(pages) > self.width:
            self._widen_tables(len(pages))
        table = self.table_of(layer, row)[head]
        table[: len(pages)] = pages
        table[len(pages) :] = 0
        self.counts[layer, row, head] = len(pages)
        self.page_starts[layer, row, head] = pages[-1] * self.block_size if pages else 0
        self.changes.rows.add(row)

    def free_pages(self, pool: int, row: int) -> list[int]:
        return self.free[pool, row, self.free_start[pool, row] : self.free_end[pool, row]].tolist()

    def set_free(self, pool: int, row: int, pages: list[int]) -> None:
        if len(pages) > self.free.shape[2]:
            self._widen_free(len(pages))
        self.free[pool, row, : len(pages)] = pages
        self.free_start[pool, row], self.free_end[pool, row] = 0, len(pages)

    def extend_free(self, rows: np.ndarray, pages: np.ndarray) -> None:
        """Add ``pages[pool, i]`` (``pages`` [pools, len(rows), n]) at the end of each pool's free pages of row
        ``rows[i]`` (distinct rows): the blocks a step appended to every request of a batch, in one call."""
        count = pages.shape[2]
        ends = self.free_end[:, rows]
        full = ends + count > self.free.shape[2]
        if full.any():  # rows whose free pages reach the end: moved to the front, the array widened if need be
            for row in rows[full.any(axis=0)].tolist():
                held = [self.free_pages(pool, row) for pool in range(self.num_pools)]
                if max(map(len, held)) + count > self.free.shape[2]:
                    self._widen_free(max(map(len, held)) + count)
                for pool, pages_held in enumerate(held):
                    self.set_free(pool, row, pages_held)
            ends = self.free_end[:, rows]
        columns = ends[:, :, None] + np.arange(count)
        self.free[np.arange(self.num_pools)[:, None, None], rows[None, :, None], columns] = pages
        self.free_end[:, rows] += count

    # The step.

    def append(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Room for ``counts[i]`` new tokens in every (layer, head) of row ``rows[i]`` (distinct rows); their
        slots, [layers, sum(heads * counts)], ordered (row, head, token). A head whose last page is full takes
        the first free page of its pool, pools in order of (row, layer, head)."""
        heads = self.num_heads
        first_rows = np.array_equal(rows, np.arange(len(rows)))  # the step's rows, arranged: views, not copies
        index = slice(0, len(rows)) if first_rows else rows
        lengths = self.lengths[:, index]
        decode = bool((counts == 1).all())
        if decode:  # a head needs a page when its pages are full
            missing = lengths == self.counts[:, index] * self.block_size
        else:
            grown = lengths + counts[None, :, None].astype(np.int32)
            missing = self._page_of(grown + self.block_size - 1) - self.counts[:, index]
        if missing.any():
            self._take_free(rows, missing)
        if decode:  # one token per head, in its last page (taken above if the others were full)
            starts = self.page_starts[:, index].reshape(self.num_layers, -1)
            slots = starts + self._offset_of(lengths.reshape(self.num_layers, -1))
            self.lengths[:, index] += 1
            return slots
        entry, head_of, nth = virtual_tokens(counts, heads)
        positions = lengths[:, entry, head_of] + nth  # [layers, virtual tokens]
        table_rows = rows[entry] * heads + head_of
        width = self.width
        layer_base = np.arange(self.num_layers)[:, None] * (self.num_rows * heads * width)
        pages = self.tables.reshape(-1)[layer_base + table_rows * width + self._page_of(positions)]
        slots = pages.astype(np.int64) * self.block_size + self._offset_of(positions)
        self.lengths[:, index] = grown
        return slots

    def _page_of(self, positions: np.ndarray) -> np.ndarray:
        """``positions // block_size``; a shift for the usual power-of-two block sizes (numpy's division is
        far slower, and a decode step divides every (layer, head) of the batch)."""
        if self.block_size & (self.block_size - 1) == 0:
            return positions >> (self.block_size.bit_length() - 1)
        return positions // self.block_size

    def _offset_of(self, positions: np.ndarray) -> np.ndarray:
        """``positions % block_size``, a mask for power-of-two block sizes (as ``_page_of``)."""
        if self.block_size & (self.block_size - 1) == 0:
            return positions & (self.block_size - 1)
        return positions % self.block_size

    def _take_free(self, rows: np.ndarray, missing: np.ndarray) -> None:
        """Give (layer, ``rows[i]``, head) ``missing[layer, i, head]`` pages more (bool: one) from the front of
        its pool's free pages."""
        num_layers, num_rows, heads = missing.shape
        by_pool = missing.transpose(1, 0, 2) if self.pools_layers else missing  # a row's heads take from one pool
        taking = np.flatnonzero(by_pool)  # in (row, layer, head) order with one pool, else (layer, row, head)
        pair, head = np.divmod(taking, heads)
        if self.pools_layers:
            entry, layer = np.divmod(pair, num_layers)
            row = rows[entry]
            group = row  # one pool of one row: consecutive entries
        else:
            layer, entry = np.divmod(pair, num_rows)
            row = rows[entry]
            group = layer * self.num_rows + row
        head_index = (layer * self.num_rows + row) * self.num_heads + head  # into ``counts``, flat
        bounds = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1], [True])))
        starts, sizes = bounds[:-1], np.diff(bounds)  # each pool-row's first entry, and its entries
        if missing.dtype == bool:  # decode: one page each
            ahead = np.arange(group.size) - np.repeat(starts, sizes)  # pages taken before in its pool
            taken = self._pop_free(group, ahead, layer)
            columns = self.counts.reshape(-1)[head_index]
            self._write_pages(head_index, columns, taken)
            self.counts.reshape(-1)[head_index] = columns + 1
            self.page_starts.reshape(-1)[head_index] = taken.astype(np.int64) * self.block_size
            self.free_start.reshape(-1)[group[starts]] += sizes
            return
        wanted = by_pool.reshape(-1)[taking].astype(np.int64)
        ends = np.cumsum(wanted)
        each = np.repeat(np.arange(wanted.size), wanted)  # one per page taken
        nth = np.arange(each.size) - np.repeat(ends - wanted, wanted)
        ahead = (ends - wanted - np.repeat((ends - wanted)[starts], sizes))[each] + nth
        taken = self._pop_free(group[each], ahead, layer[each])
        self._write_pages(head_index[each], self.counts.reshape(-1)[head_index][each] + nth, taken)
        self.counts.reshape(-1)[head_index] += wanted.astype(np.int32)
        last = nth == wanted[each] - 1  # each head's last page taken
        self.page_starts.reshape(-1)[head_index[each][last]] = taken[last].astype(np.int64) * self.block_size
        self.free_start += (
            np.bincount(group, weights=wanted, minlength=self.free_start.size)
            .reshape(self.free_start.shape)
            .astype(np.int64)
        )

    def _pop_free(self, group: np.ndarray, ahead: np.ndarray, layer: np.ndarray) -> np.ndarray:
        """The free page ``ahead[i]`` places past the front of pool-row ``group[i]`` (pool * rows + row)."""
        place = self.free_start.reshape(-1)[group] + ahead
        short = place >= self.free_end.reshape(-1)[group]
        if short.any():
            raise RuntimeError(f"no free page left in layer {int(layer[short][0])}: the request outgrew its blocks")
        return self.free.reshape(-1)[group * self.free.shape[2] + place]

    def _write_pages(self, head_index: np.ndarray, columns: np.ndarray, pages: np.ndarray) -> None:
        """``pages[i]`` into column ``columns[i]`` of table row ``head_index[i]`` (flat (layer, row, head)),
        widening the tables first if a column is past them; listed for ``take_changes``."""
        if columns.max() >= self.width:
            self._widen_tables(int(columns.max()) + 1)
        flat = head_index * self.width + columns
        self.tables.reshape(-1)[flat] = pages
        self.changes.flat.append(flat)
        self.changes.values.append(pages)

    def take_changes(self) -> StoreChanges:
        """The changes to ``tables`` since the last call, for a copy of them to follow; starts a new list."""
        changes, self.changes = self.changes, StoreChanges(resized=False)
        return changes

    # Growth (rare: the arrays double).

    def _grow_rows(self, rows: int) -> None:
        extra = rows - self.num_rows
        for name in ROW_ARRAYS:
            array = getattr(self, name)
            padding = [(0, 0)] * array.ndim
            padding[1] = (0, extra * (array.shape[1] // self.num_rows))
            setattr(self, name, np.pad(array, padding))
        self.owners.extend([None] * extra)
        self._resized()

    def _widen_tables(self, width: int) -> None:
        self.tables = np.pad(self.tables, ((0, 0), (0, 0), (0, max(width, 2 * self.width) - self.width)))
        self._resized()

    def _widen_free(self, width: int) -> None:
        self.free = np.pad(self.free, ((0, 0), (0, 0), (0, max(width, 2 * self.free.shape[2]) - self.free.shape[2])))

    def _resized(self) -> None:
        self.changes = StoreChanges(resized=True)
