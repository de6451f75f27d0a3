"""Select (OmniKV): decode rows attend to the pages filter layers select; with ``--kv-offload``, sparse layers
live in a host pool.

``Select`` follows each offloaded request (``OffloadedRequest``) and builds each step: decode rows over their
budget select their context, completing prompts over budget move their sparse layers to the host pool.
``SelectionPath`` runs it in every layer: full-attention layers as stock (offloaded rows per head over their
resident pages), a filter layer scores each decode row's context with its last token, sparse layers attend to
the selection (offloaded rows after loading it from the host pool into staging pages, ``PageCopies``). All
tensor work on the cache goes through ``KVOps``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpolicy.paging import HostPagePool, OffloadedRequest, OffloadPlan, PageCopies, offload_blocks
from kvpolicy.policies.omnikv import PageChoice
from kvpolicy.vllm.messages import BlockRelease
from kvpolicy.vllm.worker.modes.base import HostBatch, ModePath, ModeState, RequestStep, Row, StepShape
from kvpolicy.vllm.worker.step import (
    AttentionBatch,
    ContextSelection,
    HeadRows,
    OffloadedBatch,
    PlatformAttend,
    PlatformWrite,
    SelectingStep,
)


def staging_pages(budget: int, block_size: int) -> int:
    """Pages an offloaded request keeps on the device per sparse layer and head for the selected context."""
    return -(-budget // block_size) - 1


@dataclass(frozen=True)
class OffloadedRow:
    """A decode row of an offloaded request, and the tokens its sparse layers attend to."""

    row: Row
    request: OffloadedRequest
    budget: int


class Select(ModeState[OffloadedRequest]):
    """OmniKV's requests: only offloaded ones hold state (their pages), made at their offload."""

    host: HostPagePool | None = None
    _source_layers: list[int | None] | None = None

    def pages_of(self, request: OffloadedRequest) -> OffloadedRequest:
        return request

    def dropped(self, request: OffloadedRequest) -> None:
        self.host.release(request.host_page_ids(), request.host_reserved)

    def host_pool(self) -> HostPagePool:
        """The host tier, ``--kv-offload`` GiB of one-head pages, made at first use."""
        if self.host is None:
            pages = self.worker.page_space().pages
            page_bytes = pages[0].nbytes
            self.host = HostPagePool(
                int(self.worker.config.offload * 2**30) // page_bytes,
                pages[0].numel(),
                pages.dtype,
                pin=torch.cuda.is_available(),
            )
        return self.host

    def source_layers(self, num_layers: int) -> list[int | None]:
        """Per layer, the filter layer whose selection it attends to (None: full attention)."""
        if self._source_layers is None:
            self._source_layers = self.policy.source_layers(num_layers)
        return self._source_layers

    def build(self, batch: HostBatch, shape: StepShape) -> SelectingStep | None:
        """Decode rows whose context is over their budget attend sparsely in the sparse layers; with
        ``--kv-offload``, prompts over budget move their sparse layers to the host pool."""
        config = self.worker.config
        selected: list[tuple[Row, int]] = []
        offloaded: list[OffloadedRow] = []
        offloads: list[OffloadPlan] = []
        for row in self.rows(batch):
            budget = config.sparse_budget(row.seq_len, shape.num_layers, row.budget_arg)
            request = self.requests.get(row.req_id)
            if request is not None:
                if row.query_len != 1:
                    raise RuntimeError("an offloaded request takes one new token per step")
                offloaded.append(OffloadedRow(row, request, budget))
            elif not self._decoding(row):
                needed = self.written_blocks(self.request_step(row, shape))
                if needed is not None:
                    offload = self._offload(row, batch, budget, needed, shape)
                    if offload is not None:
                        offloads.append(offload)
            elif budget < row.seq_len:
                selected.append((row, budget))
        if not (selected or offloaded or offloads):
            return None
        away = [row.index for row, _ in selected] + [o.row.index for o in offloaded]
        step = SelectingStep(
            sources=self.source_layers(shape.num_layers),
            stock=shape.stock_batch(batch, away),
            context=self._context(selected, batch, shape) if selected else None,
            offloads=offloads,
        )
        if offloaded:
            step.offloaded = self._offloaded_batch(offloaded, batch, shape)
            step.resident = shape.stock_batch(batch, [o.row.index for o in offloaded])
        return step

    @staticmethod
    def _decoding(row: Row) -> bool:
        """A decode row: one new token past the prompt (prompt and recompute chunks attend fully)."""
        return row.query_len == 1 and row.prompt_len < row.seq_len == row.request.num_tokens

    @staticmethod
    def _context(selected: list[tuple[Row, int]], batch: HostBatch, shape: StepShape) -> ContextSelection:
        rows = np.array([row.index for row, _ in selected])
        lengths = np.array([row.seq_len for row, _ in selected], dtype=np.int64)
        table = batch.block_table.numpy()[rows, : int(shape.num_blocks(lengths.max()))]
        heads = shape.num_kv_heads
        page_ids = table.astype(np.int64)[:, None, :] * heads + np.arange(heads)[None, :, None]
        choice = PageChoice.of(lengths, shape.block_size, [budget for _, budget in selected])
        # Every page but the current (last) one is full: the pages left out take whole blocks of tokens.
        kept_tokens = lengths - (choice.num_pages - choice.counts) * shape.block_size
        return ContextSelection(
            token_idx=torch.from_numpy(batch.query_start_loc[rows].astype(np.int64)),
            lengths=torch.from_numpy(lengths),
            table=torch.from_numpy(np.ascontiguousarray(table)),
            page_ids=torch.from_numpy(page_ids),
            choice=choice,
            kept=torch.from_numpy(choice.kept),
            last=torch.from_numpy(choice.num_pages - 1),
            seq_lens=torch.from_numpy(kept_tokens.astype(np.int32)),
            plan=shape.rows_plan,
        )

    @staticmethod
    def written_blocks(step: RequestStep) -> int | None:
        """The mode's rule: with ``--kv-offload``, a prompt read whole this step whose context is over its
        sparse budget moves its sparse layers to the host pool and packs what stays into its first blocks
        (``offload_blocks``); nothing else is written."""
        if step.config.offload is None:
            return None
        decoding = step.query_len == 1 and step.prompt_len < step.end
        budget = step.config.sparse_budget(step.end, step.num_layers, step.budget_arg)
        if not step.complete or decoding or budget >= step.end:
            return None
        full = [source is None for source in step.policy.source_layers(step.num_layers)]
        return offload_blocks(
            full, step.num_kv_heads, step.block_size, step.end, staging_pages(budget, step.block_size)
        )

    def _offload(self, row: Row, batch: HostBatch, budget: int, needed: int, shape: StepShape) -> OffloadPlan | None:
        """Plan the offload of a prompt that completes this step (``needed``: the blocks it writes); None
        when the host pool is full, or when with prefix caching its own blocks cannot hold what stays on
        the device."""
        space = self.worker.page_space()
        num_blocks = shape.num_blocks(row.seq_len)
        order, _ = self.worker.writable_blocks(row.req_id, num_blocks)
        if min(needed, num_blocks) > len(order):
            self.worker.counters["shared_prefix_uncompressed"] += 1
            return None
        request = OffloadedRequest(
            space.layer_base,
            shape.num_kv_heads,
            shape.block_size,
            batch.block_table[row.index][:num_blocks].tolist(),
            [source is None for source in self.source_layers(shape.num_layers)],
            order,
        )
        staging = staging_pages(budget, shape.block_size)
        try:
            plan = request.offload(row.seq_len, self.host_pool(), staging, shape.max_model_len)
        except MemoryError:
            self.worker.counters["offload_refused"] += 1
            return None
        self.requests[row.req_id] = request
        self.worker.releases[row.req_id] = BlockRelease(request, keep=plan.keep_blocks)
        return plan

    def _offloaded_batch(self, rows: list[OffloadedRow], batch: HostBatch, shape: StepShape) -> OffloadedBatch:
        heads = shape.num_kv_heads
        host = self.host_pool()
        slots, flushes = [], []
        for offloaded in rows:
            request = offloaded.request
            num_blocks = shape.num_blocks(request.length + 1)
            request.add_blocks(batch.block_table[offloaded.row.index, len(request.blocks) : num_blocks].tolist())
            row_slots, row_flushes = request.append(host)
            slots.append(row_slots)
            flushes.append(row_flushes)
        token_idx = torch.tensor([offloaded.row.first_token for offloaded in rows], dtype=torch.int64)
        requests = [offloaded.request for offloaded in rows]
        query_start_loc = torch.arange(len(rows) * heads + 1, dtype=torch.int32)
        seq_lens = torch.tensor([r.length for r in requests], dtype=torch.int32).repeat_interleave(heads)
        full = {}
        for layer, source in enumerate(self.source_layers(shape.num_layers)):
            if source is None:
                table = padded_table([pages for request in requests for pages in request.full_table(layer)])
                full[layer] = AttentionBatch(
                    token_idx, query_start_loc, seq_lens, table, 1, shape.heads_plan(query_start_loc, seq_lens, table)
                )
        whole_batch = len(rows) == int(batch.query_start_loc[-1])
        return OffloadedBatch(
            token_idx=token_idx,
            rows=HeadRows(token_idx.repeat_interleave(heads), torch.arange(heads).repeat(len(rows)), whole_batch),
            requests=requests,
            budgets=[offloaded.budget for offloaded in rows],
            slots=torch.stack(slots, dim=1).reshape(shape.num_layers, -1),
            flushes=PageCopies.cat([copies for row in flushes for copies in row]),
            full=full,
            plan=shape.heads_plan,
        )


def pad_columns(table: torch.Tensor, width: int) -> torch.Tensor:
    """A block table zero-padded on the right to ``width`` columns."""
    return torch.nn.functional.pad(table, (0, width - table.shape[1]))


def padded_table(rows: list[list[int]]) -> torch.Tensor:
    """A block table with one row per virtual sequence, zero-padded to the longest."""
    table = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int32)
    for i, pages in enumerate(rows):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table


class SelectionPath(ModePath):
    mode: Select

    def write(self, layer, key, value, kv_cache, step: SelectingStep, platform_write: PlatformWrite) -> None:
        """Offloaded rows' new K/V into their tail pages, after the full ones (of every layer, in the first)
        are flushed to the host; the platform writes the resident rows."""
        offloaded = step.offloaded
        if offloaded is None:
            platform_write(None)
            return
        platform_write(self.ops.on_device(step.resident.token_idx, key.device))
        pages = self.worker.page_space().pages
        layer_idx = self.layer_index(layer)
        if layer_idx == 0 and offloaded.flushes.src.numel():  # every layer's, before any layer reads the pool
            copied = self.ops.copy_pages(pages.flatten(1), self.mode.host.pages, offloaded.flushes)
            self.worker.counters["offloaded_kv_pages"] += copied
        self.ops.write(layer, pages, key, value, offloaded.rows, offloaded.slots[layer_idx])

    def attend(self, layer, query, out, kv_cache, step: SelectingStep, full_attention: PlatformAttend) -> None:
        """One layer of a selecting step; ``full_attention()`` is the platform's stock call over every row.

        Offloaded rows attend per head over the whole KV buffer: full layers to their own pages, sparse
        layers to the selected pages loaded from the host pool into staging pages, then their tail. A filter
        layer starts the loads of every sparse layer that reads its choice (``KVOps.load_pages``), so they
        overlap the layers in between; each sparse layer waits for its own before it attends.
        """
        context, offloaded = step.context, step.offloaded
        layer_idx = self.layer_index(layer)
        source = step.sources[layer_idx]
        pages = self.worker.page_space().pages if offloaded is not None or step.offloads else None
        if source is None:
            filter_layer, scores = layer_idx in self.worker.policy.filter_layers, None
            # In a filter layer, decode rows that leave pages out attend and are scored in one pass over
            # their keys; the other rows attend as stock.
            fused = filter_layer and context is not None and context.choice.drops
            if offloaded is None and not fused:
                full_attention()
            else:
                self.ops.attend(layer, query, out, kv_cache, step.stock if fused else step.resident)
                if fused:
                    scores = self.ops.context_attention(
                        layer, query, out, kv_cache, context.page_ids, context.token_idx, context.lengths
                    )
                if offloaded is not None and filter_layer:
                    chosen = self._select_offloaded(layer, query, out, pages, layer_idx, offloaded)
                    # The sparse layers after it load their pages now, on the side, and wait just before reading.
                    for sparse, chooser in enumerate(step.sources):
                        if chooser == layer_idx:
                            offloaded.loaded[sparse] = self._load_selection(pages, sparse, offloaded, chosen)
                elif offloaded is not None:
                    self.ops.attend(layer, query, out, pages, offloaded.full[layer_idx], offloaded.rows)
            if filter_layer and context is not None:
                context.selected[layer_idx] = self._select(kv_cache.shape[1], context, step.stock, scores)
        else:
            # One call: the selected rows over their pages, the stock rows (if any) over all theirs.
            self.ops.attend(layer, query, out, kv_cache, step.stock if context is None else context.selected[source])
            if offloaded is not None:
                batch, pending = offloaded.loaded[layer_idx]
                self.ops.wait_pages(pending)
                self.ops.attend(layer, query, out, pages, batch, offloaded.rows)
        if step.offloads and layer_idx == len(step.sources) - 1:
            self._move_offloads(pages, step.offloads)

    def _count(self, choice: PageChoice) -> None:
        self.worker.counters["context_pages"] += int(choice.num_pages.sum())
        self.worker.counters["selected_pages"] += int(choice.counts.sum())

    def _select(self, heads: int, context: ContextSelection, stock: AttentionBatch, scores) -> AttentionBatch:
        """Choose each decode row's pages by its last token's attention (eq. 3-4; ``scores`` [rows, pages]
        as the filter layer made them, None when every row keeps every page, then nothing was scored) and
        build the sparse layers' call: ``stock``'s rows over all their pages, then the decode rows over
        their selected pages. The choice and the table it fills stay where the scores are: only how many
        pages each row keeps, which the host knows, sizes the call."""
        choice = context.choice
        self._count(choice)
        if scores is None:
            most = choice.kept.shape[1]
            block_table = torch.where(torch.from_numpy(choice.kept), context.table[:, :most], 0)
        else:
            kept, last, table = (
                self.ops.on_device(t, scores.device) for t in (context.kept, context.last, context.table)
            )
            block_table = torch.where(kept, torch.gather(table, 1, choice.choose(scores, kept, last)), 0)
        seq_lens, token_idx = context.seq_lens, context.token_idx
        query_start_loc = torch.arange(len(token_idx) + 1, dtype=torch.int32)
        if stock.token_idx.numel():
            width = max(stock.block_table.shape[1], block_table.shape[1])
            stock_table = self.ops.on_device(stock.block_table, block_table.device)
            block_table = torch.cat([pad_columns(stock_table, width), pad_columns(block_table, width)])
            seq_lens = torch.cat([stock.seq_lens, seq_lens])
            token_idx = torch.cat([stock.token_idx, token_idx])
            query_start_loc = torch.cat([stock.query_start_loc, stock.query_start_loc[-1] + query_start_loc[1:]])
        plan = context.plan(query_start_loc, seq_lens, block_table)
        in_order = bool(np.array_equal(token_idx.numpy(), np.arange(len(token_idx))))
        return AttentionBatch(token_idx, query_start_loc, seq_lens, block_table, heads, plan, in_order)

    def _select_offloaded(
        self, layer, query, out, pages, layer_idx: int, offloaded: OffloadedBatch
    ) -> list[np.ndarray]:
        """A filter layer for offloaded rows: their attention over their own pages and the choice it makes,
        in one pass over their keys when some row leaves pages out (as for resident rows). The choice goes
        to the host, which keeps the staging pages: the one read back of a selecting step."""
        batch = offloaded.full[layer_idx]
        page_ids = batch.block_table.long().view(len(offloaded.requests), -1, batch.block_table.shape[1])
        lengths = torch.tensor([request.length for request in offloaded.requests])
        choice = PageChoice.of(lengths.numpy(), pages.shape[2], offloaded.budgets)
        self._count(choice)
        if choice.drops:
            scores = self.ops.context_attention(layer, query, out, pages, page_ids, offloaded.token_idx, lengths)
            chosen = choice.choose(scores).cpu().numpy()
        else:
            self.ops.attend(layer, query, out, pages, batch, offloaded.rows)
            chosen = np.where(choice.kept, np.arange(choice.kept.shape[1]), 0)
        return [row[:count] for row, count in zip(chosen, choice.counts.tolist())]

    def _load_selection(self, pages, layer_idx: int, offloaded: OffloadedBatch, chosen) -> tuple[AttentionBatch, Any]:
        """Start copying a sparse layer's selected pages from the host pool into its staging pages (pages
        still staged from the last step stay); the call that reads them, and what to wait on first."""
        calls = [
            request.sparse_call(layer_idx, rows_pages.tolist())
            for request, rows_pages in zip(offloaded.requests, chosen)
        ]
        loads = PageCopies.cat([call.loads for call in calls])
        pending = self.ops.load_pages(self.mode.host.pages, pages.flatten(1), loads)
        self.worker.counters["loaded_kv_pages"] += loads.src.numel()
        heads = len(offloaded.rows.token_of) // len(calls)
        table = padded_table([pages for call in calls for pages in call.table])
        seq_lens = torch.tensor([call.seq_len for call in calls], dtype=torch.int32).repeat_interleave(heads)
        query_start_loc = torch.arange(len(calls) * heads + 1, dtype=torch.int32)
        batch = AttentionBatch(
            offloaded.token_idx, query_start_loc, seq_lens, table, 1, offloaded.plan(query_start_loc, seq_lens, table)
        )
        return batch, pending

    def _move_offloads(self, pages, offloads: list[OffloadPlan]) -> None:
        """After the last layer: sparse layers' completed pages to the host, then the rest packed into
        the blocks each request keeps (every source read before any destination is written)."""
        flat = pages.flatten(1)
        for plan in offloads:
            self.worker.counters["offloaded_kv_pages"] += self.ops.copy_pages(flat, self.mode.host.pages, plan.to_host)
            self.ops.copy_pages(flat, flat, plan.on_device)
            self.worker.counters["offloaded_requests"] += 1
