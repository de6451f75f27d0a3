"""Decode steps in fixed shapes, for vLLM's full CUDA graphs.

vLLM replays a full graph for a batch whose every row brings one token, picked by the padded batch size before
any metadata exists, with the captured arguments. So such a step runs every row, relocated or not, as ``H``
one-head sequences (a row still in vLLM's layout as head ``h`` over pages ``block*H + h``), through one write and
one attention call per layer over persistent buffers at fixed offsets, its grid sized for ``max_model_len``; the
builder writes each step into the buffers before the model runs, padded rows length 0. Only a policy with no host
work after attention in decode qualifies (``refusal``), and no step with prompt rows is replayed
(``patches.forbid_full_graphs_while``). How it fits the CUDA step: docs/architecture.md.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from kvpolicy.paging import stock_page_tables
from kvpolicy.policies import Mode, Policy
from kvpolicy.vllm.worker.modes.base import HostBatch, ModePath, StepShape
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.ops.staging import TableMirror
from kvpolicy.vllm.worker.step import (
    AttentionBatch,
    FixedDecodeInputs,
    FixedDecodeStep,
    HeadRows,
    PlatformAttend,
    PlatformWrite,
    RelocatingStep,
)

#: The most the fixed-shape buffers may take on the device; past it, attention stays outside graphs.
MAX_BUFFER_BYTES = 1 << 30


def refusal(policy: type[Policy] | Policy, offload: bool) -> str | None:
    """Why a policy's decode steps cannot run in fixed shapes (None: they can)."""
    if policy.mode is not Mode.RELOCATE:
        return f"{policy.name}'s decode runs on its own path ({policy.mode.traits.name})"
    if policy.schedule.in_decode:
        return f"{policy.name} evicts in decode (host work after attention when a page fills)"
    if policy.inputs.new_token_attention:
        return f"{policy.name} adds each new token's attention to its scores"
    if offload:
        return "an offloaded request's layers load from the host pool"
    return None


def buffer_bytes(num_layers: int, kv_heads: int, rows: int, max_model_len: int, block_size: int) -> int:
    """The device memory of ``FixedDecode``'s buffers: per layer and one-head sequence, a page table
    ``max_model_len / block_size`` wide, a length and a slot."""
    width = -(-max_model_len // block_size)
    return num_layers * rows * kv_heads * (4 * width + 4 + 8)


class FixedDecodeCalls:
    """One padded batch size's calls: views of the buffers, made once (not a dataclass: the staging of a
    step searches dataclasses for host tensors, and these are the device's own)."""

    def __init__(self, rows: HeadRows, layers: list[AttentionBatch], slots: torch.Tensor):
        self.rows = rows
        self.layers = layers
        self.slots = slots


class FixedDecodePath(ModePath):
    """Runs a ``FixedDecodeStep`` in each layer: one write and one attention call over the buffers."""

    def write(self, layer, key, value, kv_cache, step: FixedDecodeStep, platform_write: PlatformWrite) -> None:
        calls = step.calls
        cache = self.mode.relocated_cache(kv_cache)
        self.ops.write(layer, cache, key, value, calls.rows, calls.slots[self.layer_index(layer)])

    def attend(self, layer, query, out, kv_cache, step: FixedDecodeStep, platform_attend: PlatformAttend) -> None:
        calls = step.calls
        cache = self.mode.relocated_cache(kv_cache)
        self.ops.attend(layer, query, out, cache, calls.layers[self.layer_index(layer)], calls.rows)


class FixedDecode:
    """A relocating mode's device state for fixed-shape decode steps: the buffers, sized for ``max_rows``
    rows of ``H`` one-head sequences in every layer, and the calls of each padded size over them."""

    def __init__(self, mode, ops: KVOps, shape: StepShape, max_rows: int, head_size: int, device):
        heads, layers = shape.num_kv_heads, shape.num_layers
        self.shape, self.ops, self.head_size = shape, ops, head_size
        self.max_rows = max_rows
        sequences = max_rows * heads
        virtual = torch.arange(sequences, device=device)
        self.token_of, self.head_of = virtual // heads, virtual % heads
        self.query_start_loc = torch.arange(sequences + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(layers, sequences, dtype=torch.int32, device=device)
        self.tables = torch.zeros(layers, sequences, shape.num_blocks(shape.max_model_len), dtype=torch.int32,
                                  device=device)  # fmt: skip
        self.slots = torch.full((layers, sequences), -1, dtype=torch.int64, device=device)
        self.path = FixedDecodePath(mode, ops)
        self._calls: dict[int, FixedDecodeCalls] = {}
        self.steps: Counter[int] = Counter()  # padded rows -> fixed-shape steps built, for tests and logs

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer a fixed-shape call reads its indices from (for tests that watch the launches)."""
        return [self.token_of, self.head_of, self.query_start_loc, self.seq_lens, self.tables, self.slots]

    def calls(self, rows: int) -> FixedDecodeCalls:
        """The calls of a batch padded to ``rows`` rows: the same views, plan and workspace at every step."""
        known = self._calls.get(rows)
        if known is None:
            n = rows * self.shape.num_kv_heads
            device = self.seq_lens.device
            plan = self.ops.fixed_decode_plan(n, self.shape.max_model_len, self.shape.queries_per_kv,
                                              self.head_size, device)  # fmt: skip
            token_idx, qsl = torch.arange(rows), self.query_start_loc[: n + 1]
            layers = [
                AttentionBatch(token_idx, qsl, lens[:n], table[:n], 1, plan)
                for lens, table in zip(self.seq_lens, self.tables)
            ]
            rows_of = HeadRows(self.token_of[:n], self.head_of[:n], whole_batch=True)
            known = self._calls[rows] = FixedDecodeCalls(rows_of, layers, self.slots[:, :n])
        return known

    def step_of(self, built: RelocatingStep, batch: HostBatch) -> FixedDecodeStep | None:
        """The fixed-shape form of a built step whose every request brings one token, or None: a step with
        prompt work, or more rows than the buffers hold. Rows past the batch's requests are padding, with
        no token (a replay's) or one (a capture's dummy batch): length 0, no slot."""
        rows, real = batch.num_reqs, len(batch.req_ids)
        if rows > self.max_rows or built.relocations or built.window_stash or built.summed:
            return None
        if (np.diff(batch.query_start_loc[: real + 1]) != 1).any():
            return None
        shape = self.shape
        heads, block_size = shape.num_kv_heads, shape.block_size
        per_head = built.per_head
        head = np.arange(heads)
        relocated = np.zeros(0, dtype=np.int64)
        is_stock = np.ones(real, dtype=bool)
        if per_head is not None:
            relocated_rows = per_head.token_idx.numpy()  # one token per row: its token is its row
            is_stock[relocated_rows] = False
            relocated = (relocated_rows[:, None] * heads + head).reshape(-1)
        stock_rows = np.flatnonzero(is_stock)
        stock = (stock_rows[:, None] * heads + head).reshape(-1)
        lengths = batch.seq_lens.numpy()[stock_rows].astype(np.int64)
        blocks = batch.block_table.numpy()[stock_rows].astype(np.int64)
        width = int(shape.num_blocks(lengths.max())) if len(stock_rows) else 0
        stock_tables = stock_page_tables(torch.from_numpy(blocks[:, :width]), heads).numpy()
        last = np.repeat(lengths - 1, heads)  # each sequence's new token, in its page from the table
        stock_slots = stock_tables[np.arange(len(stock)), last // block_size] * block_size + last % block_size
        inputs = FixedDecodeInputs(
            torch.from_numpy(relocated),
            torch.from_numpy(stock),
            torch.from_numpy(np.repeat(lengths, heads).astype(np.int32)),
            torch.from_numpy(stock_slots),
            torch.from_numpy(stock_tables.astype(np.int32)),
            real,
        )
        step = FixedDecodeStep(inputs, per_head, self.calls(rows))
        step.path = self.path
        self.steps[rows] += 1
        return step

    def fill(self, step: FixedDecodeStep, tables: TableMirror) -> None:
        """Write a staged step into the buffers (device copies, outside any graph): the relocated rows'
        lengths and slots from their per-head batch and page tables from the mirror of the mode's tables,
        the stock rows' from the step's inputs, the padding's emptied."""
        inputs, device, per_head = step.inputs, self.seq_lens.device, step.per_head
        on_device = [
            self.ops.on_device(t, device)
            for t in (inputs.relocated, inputs.stock, inputs.stock_lens, inputs.stock_slots, inputs.stock_tables)
        ]
        relocated_parts = None
        if per_head is not None:
            mirror = tables.tables.view(self.shape.num_layers, -1, tables.tables.shape[-1])
            lens, slots = (self.ops.on_device(t, device) for t in (per_head.seq_lens, per_head.slots))
            relocated_parts = lens, slots, mirror
        n = step.calls.slots.shape[1]
        padding = slice(inputs.requests * self.shape.num_kv_heads, n)
        write_buffers(self.seq_lens, self.slots, self.tables, padding, *on_device, relocated_parts)


def write_buffers(
    seq_lens, slots, tables, padding, relocated, stock, stock_lens, stock_slots, stock_tables, relocated_parts
) -> None:
    """The device's work of ``FixedDecode.fill`` (a function of its own, as ``staging.update_tables`` is, for
    the host-time benchmark to leave out). Into the buffers' sequences: the relocated ones' lengths, slots
    and page tables from ``relocated_parts`` (their per-head batch's [layers, sequences] and the mode's
    device tables [layers, rows, pages], those rows first), the stock ones' the same in every layer, the
    ``padding`` ones' length 0 and no slot."""
    layers = seq_lens.shape[0]
    seq_lens[:, padding].fill_(0)
    slots[:, padding].fill_(-1)
    if relocated_parts is not None:
        lens, new_slots, mirror = relocated_parts
        seq_lens.index_copy_(1, relocated, lens)
        slots.index_copy_(1, relocated, new_slots)
        width = min(mirror.shape[-1], tables.shape[-1])
        tables[:, :, :width].index_copy_(1, relocated, mirror[:, : relocated.numel(), :width])
    if stock.numel():
        seq_lens.index_copy_(1, stock, stock_lens.expand(layers, -1))
        slots.index_copy_(1, stock, stock_slots.expand(layers, -1))
        width = stock_tables.shape[1]
        tables[:, :, :width].index_copy_(1, stock, stock_tables.expand(layers, -1, -1))
