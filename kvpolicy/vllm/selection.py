"""The context-selection path (OmniKV): filter layers choose pages, the layers after them attend to those.

Full-attention layers attend as stock (or, for offloaded rows, per head over
their resident pages); a filter layer scores each decode row's context with
its last token and builds the sparse call; sparse layers attend to the
selection (offloaded rows: the selected pages loaded from the host pool into
staging pages first). All tensor work on the cache goes through ``KVOps``;
whole-page copies to and from the host tier are ``PageCopies``.
"""

from __future__ import annotations

import torch

from kvpolicy.paging import OffloadPlan, PageCopies
from kvpolicy.policies.omnikv import select_pages
from kvpolicy.vllm.ops import KVOps
from kvpolicy.vllm.state import WORKER_STATE
from kvpolicy.vllm.step import AttentionBatch, ContextSelection, OffloadedBatch, SelectingStep
from kvpolicy.vllm.step_builder import padded_table


class SelectionPath:
    def __init__(self, ops: KVOps):
        self.ops = ops

    def write(self, layer, layer_idx: int, key, value, offloaded: OffloadedBatch) -> None:
        """Offloaded rows' new K/V into their tail pages, after the full ones are flushed to the host."""
        pages = WORKER_STATE.page_space().pages
        flush = offloaded.flushes[layer_idx]
        WORKER_STATE.counters["offloaded_kv_pages"] += flush.apply(pages.flatten(1), WORKER_STATE.host.pages)
        self.ops.write(layer, pages, key, value, offloaded.rows, offloaded.slots[layer_idx])

    def attend(self, layer, layer_idx: int, query, out, kv_cache, step: SelectingStep, full_attention) -> None:
        """One layer of a selecting step; ``full_attention()`` is the platform's stock call over every row.

        Offloaded rows attend per head over the whole KV buffer: full layers to their own pages, sparse
        layers to the selected pages loaded from the host pool into staging pages, then their tail.
        """
        context, offloaded = step.context, step.offloaded
        source = step.sources[layer_idx]
        pages = WORKER_STATE.page_space().pages if offloaded is not None or step.offloads else None
        if source is None:
            if offloaded is None:
                full_attention()
            else:
                self.ops.attend(layer, query, out, kv_cache, step.resident)
                batch = offloaded.full[layer_idx]
                self.ops.attend(layer, query, out, pages, batch, offloaded.rows)
            if layer_idx in WORKER_STATE.policy.filter_layers:
                if context is not None:
                    context.selected[layer_idx] = self._select(layer, query, kv_cache, context)
                if offloaded is not None:
                    offloaded.chosen[layer_idx] = self._select_offloaded(layer, query, pages, layer_idx, offloaded)
        else:
            self.ops.attend(layer, query, out, kv_cache, step.stock)
            if context is not None:
                self.ops.attend(layer, query, out, kv_cache, context.selected[source])
            if offloaded is not None:
                batch = self._load_selection(pages, layer_idx, offloaded, offloaded.chosen[source])
                self.ops.attend(layer, query, out, pages, batch, offloaded.rows)
        if step.offloads and layer_idx == len(step.sources) - 1:
            _offload(pages, step.offloads)

    def _choose_pages(self, layer, query, cache, page_ids, token_idx, lengths, budgets) -> list[torch.Tensor]:
        """Eq. (3)-(4) and the page choice for decode rows: ``page_ids`` [rows, kv_heads, pages] in ``cache``."""
        block_size = cache.shape[2]
        scores = self.ops.context_scores(layer, query, cache, page_ids, token_idx, lengths).cpu()
        chosen = select_pages(scores, lengths, block_size, budgets)
        WORKER_STATE.counters["context_pages"] += int((-(-lengths // block_size)).sum())
        WORKER_STATE.counters["selected_pages"] += sum(c.numel() for c in chosen)
        return chosen

    def _select(self, layer, query, kv_cache, context: ContextSelection) -> AttentionBatch:
        """Score each decode row's context with its last token (eq. 3-4) and build the sparse call over its pages."""
        heads, block_size = kv_cache.shape[1:3]
        lengths = context.seq_lens.long()
        num_pages = -(-lengths // block_size)
        table = context.block_table.long()[:, : int(num_pages.max())]
        page_ids = table[:, None, :] * heads + torch.arange(heads)[None, :, None]
        chosen = self._choose_pages(layer, query, kv_cache, page_ids, context.token_idx, lengths, context.budgets)
        block_table = torch.zeros(len(chosen), max(c.numel() for c in chosen), dtype=context.block_table.dtype)
        for row, selected in enumerate(chosen):
            block_table[row, : selected.numel()] = table[row, selected].to(block_table.dtype)
        counts = torch.tensor([c.numel() for c in chosen])
        # Every page but the current (last) one is full: drop the tokens of the pages left out.
        seq_lens = (lengths - (num_pages - counts) * block_size).to(context.seq_lens.dtype)
        query_start_loc = torch.arange(len(chosen) + 1, dtype=torch.int32)
        plan = context.plan(query_start_loc, seq_lens, block_table)
        return AttentionBatch(context.token_idx, query_start_loc, seq_lens, block_table, heads, plan)

    def _select_offloaded(self, layer, query, pages, layer_idx: int, offloaded: OffloadedBatch) -> list[torch.Tensor]:
        """The filter layer's choice for offloaded rows, from its keys in the request's own pages."""
        batch = offloaded.full[layer_idx]
        page_ids = batch.block_table.long().view(len(offloaded.requests), -1, batch.block_table.shape[1])
        lengths = torch.tensor([request.length for request in offloaded.requests])
        return self._choose_pages(layer, query, pages, page_ids, offloaded.token_idx, lengths, offloaded.budgets)

    def _load_selection(self, pages, layer_idx: int, offloaded: OffloadedBatch, chosen) -> AttentionBatch:
        """Copy a sparse layer's selected pages from the host pool into staging; the call that reads them."""
        calls = [
            request.sparse_call(layer_idx, rows_pages.tolist())
            for request, rows_pages in zip(offloaded.requests, chosen)
        ]
        loads = PageCopies.cat([call.loads for call in calls])
        WORKER_STATE.counters["loaded_kv_pages"] += loads.apply(WORKER_STATE.host.pages, pages.flatten(1))
        heads = len(offloaded.rows.token_of) // len(calls)
        table = padded_table([pages for call in calls for pages in call.table])
        seq_lens = torch.tensor([call.seq_len for call in calls], dtype=torch.int32).repeat_interleave(heads)
        query_start_loc = torch.arange(len(calls) * heads + 1, dtype=torch.int32)
        return AttentionBatch(
            offloaded.token_idx, query_start_loc, seq_lens, table, 1, offloaded.plan(query_start_loc, seq_lens, table)
        )


def _offload(pages, offloads: list[OffloadPlan]) -> None:
    """After the last layer: sparse layers' completed pages to the host, then the rest packed into
    the blocks each request keeps (every source read before any destination is written)."""
    flat = pages.flatten(1)
    for plan in offloads:
        WORKER_STATE.counters["offloaded_kv_pages"] += plan.to_host.apply(flat, WORKER_STATE.host.pages)
        plan.on_device.apply(flat, flat)
        WORKER_STATE.counters["offloaded_requests"] += 1
