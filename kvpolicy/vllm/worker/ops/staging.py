"""A step's index tensors on the device in one host-to-device copy.

The step builder makes its index tensors (page tables, lengths, slots, virtual-token maps) on the host; sent one
by one, a step of a 32-layer model makes hundreds of small copies, and a GPU step waits behind each.
``StagedStep`` packs every tensor of a step into one pinned host buffer, copies it once and answers each later
request for one of them with a view of that copy; tensors made after the step was built (a relocation's moves)
go on their own. Relocated requests' page tables are not sent whole: the device keeps its own (``TableMirror``)
and the step carries only what changed since the last one.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from kvpolicy.paging import PageStore

#: Byte alignment of each storage's bytes in the staged buffer: a multiple of every element size.
ALIGN = 16


def copy_to(device: torch.device, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every host-to-device copy of the ops goes through here (one call: one copy per tensor)."""
    return [t.to(device, non_blocking=True) for t in tensors]


def _storage_address(tensor: torch.Tensor) -> int:
    """The address of the storage a tensor views (without making the storage's Python object)."""
    return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()


def _byte_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor views: [first, end)."""
    size = tensor.element_size()
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))
    first = tensor.storage_offset() * size
    return first, first + (last + 1) * size


class StagedStep:
    """The host tensors of one step, copied to ``device`` together.

    Each host storage the step's tensors view is sent once, only the bytes they
    view; ``on`` then maps any view of a staged storage (a layer's slice of the
    step's page tables, say) to the same view of the copy, without copying again.
    """

    def __init__(
        self, tensors: Iterable[torch.Tensor], device: torch.device, mirrored: dict[int, torch.Tensor] | None = None
    ):
        """``mirrored``: host storage address -> the device's copy of that storage, kept by its owner: views of
        it map to the same view of the copy and are not staged."""
        self.device = torch.device(device)
        self.mirrored = mirrored or {}
        extents: dict[int, tuple[torch.Tensor, int, int]] = {}  # storage address -> (a tensor on it, first, end)
        for tensor in tensors:
            if tensor.device.type != "cpu" or not tensor.numel() or any(s < 0 for s in tensor.stride()):
                continue
            address = _storage_address(tensor)
            if address in self.mirrored:
                continue
            first, end = _byte_extent(tensor)
            if address in extents:
                _, seen_first, seen_end = extents[address]
                first, end = min(first, seen_first), max(end, seen_end)
            extents[address] = (tensor, first - first % ALIGN, end)
        #: storage address -> (first and end host byte staged, their offset in the device buffer); the
        #: host tensors stay referenced so their storages (and so the addresses) live as long as the step.
        self.regions: dict[int, tuple[int, int, int]] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id -> (tensor, its view)
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the device buffer as each dtype, to view from
        self._sources = [tensor for tensor, _, _ in extents.values()]
        total = 0
        for address, (_, first, end) in extents.items():
            self.regions[address] = (first, end, total)
            total += -(-(end - first) // ALIGN) * ALIGN
        host = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for address, (tensor, first, end) in extents.items():
            offset = self.regions[address][2]
            storage = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
            host[offset : offset + end - first].copy_(storage[first:end])
        self.buffer = copy_to(self.device, [host])[0] if total else host.to(self.device)

    def on(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor``'s view of the staged copy; None when its storage was not staged with the step.
        Made once per tensor object: every layer asks for the same rows and calls."""
        known = self._views.get(id(tensor))
        if known is not None and known[0] is tensor:
            return known[1]
        view = self._view(tensor)
        self._views[id(tensor)] = (tensor, view)
        return view

    def _view(self, tensor: torch.Tensor) -> torch.Tensor | None:
        address = _storage_address(tensor)
        mirror = self.mirrored.get(address)
        if mirror is not None:  # the device's copy has the host storage's shape: the same offset and strides
            return mirror.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
        region = self.regions.get(address)
        if region is None or not tensor.numel():
            return None
        first, end, offset = region
        start, stop = _byte_extent(tensor)
        if start < first or stop > end:
            return None  # a view of more of the storage than the step's tensors viewed
        staged_offset = (offset + start - first) // tensor.element_size()
        typed = self._typed.get(tensor.dtype)
        if typed is None:
            typed = self._typed[tensor.dtype] = torch.empty(0, dtype=tensor.dtype, device=self.device).set_(
                self.buffer.untyped_storage()
            )
        return typed.as_strided(tensor.shape, tensor.stride(), staged_offset)

    def to_device(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` on the device: staged ones as views of the copy (on a CPU device too, so the interpreted
        tests read what a GPU reads), the rest copied, or as they are when they are there already."""
        out = []
        for tensor in tensors:
            staged = self.on(tensor) if tensor.device.type == "cpu" else None
            if staged is None:
                staged = tensor if tensor.device == self.device else copy_to(self.device, [tensor])[0]
            out.append(staged)
        return out


class TableMirror:
    """A ``PageStore``'s tables on the device, brought up to date at each step by what changed on the host:
    the rows that moved or were rewritten, whole, and the entries appends wrote one by one. The first step,
    and a step after the tables grew, sends them whole."""

    def __init__(self):
        self.store: PageStore | None = None
        self.tables: torch.Tensor | None = None

    def stage(self, store: PageStore, step_tensors: list[torch.Tensor], device: torch.device) -> StagedStep:
        """The step's staged copy with the store's changes in it, and the device's tables updated from them."""
        changes = store.take_changes()
        host = torch.from_numpy(store.tables)
        if changes.resized or self.store is not store or self.tables is None or self.tables.shape != host.shape:
            staged = StagedStep([*step_tensors, host], device)
            self.store, self.tables = store, staged.on(host).clone()
            staged.mirrored = {_storage_address(host): self.tables}
            return staged
        rows = np.fromiter(sorted(changes.rows), dtype=np.int64, count=len(changes.rows))
        by_row = store.tables.reshape(store.num_layers, store.num_rows, -1)
        flat = np.concatenate(changes.flat) if changes.flat else np.zeros(0, dtype=np.int64)
        values = np.concatenate(changes.values) if changes.values else np.zeros(0, dtype=np.int32)
        updates = [torch.from_numpy(array) for array in (rows, by_row[:, rows], flat, values)]
        staged = StagedStep([*step_tensors, *updates], device, {_storage_address(host): self.tables})
        update_tables(self.tables.view(store.num_layers, store.num_rows, -1), *staged.to_device(updates))
        return staged


def update_tables(
    tables: torch.Tensor, rows: torch.Tensor, contents: torch.Tensor, flat: torch.Tensor, values: torch.Tensor
) -> None:
    """The device's work of a ``TableMirror`` update: rows ``rows`` of ``tables`` [layers, rows, entries] rewritten
    with ``contents``, then entries ``flat`` (flat indices) set to ``values``."""
    if rows.numel():
        tables[:, rows] = contents
    if flat.numel():
        tables.view(-1)[flat] = values
