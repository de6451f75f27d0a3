"""The per-head batch of a relocating step: the relocated rows' calls, built once a step from the page store's
batch-wide arrays (``PageStore``) and read by ``PerHeadPath`` in every layer."""

from __future__ import annotations

import numpy as np
import torch

from kvpolicy.paging import PageStore, RequestPages, virtual_tokens
from kvpolicy.vllm.worker.modes.base import HostBatch, StepShape
from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows, PerHeadBatch


def per_head_batch(
    store: PageStore,
    index: np.ndarray,
    pages: list[RequestPages],
    batch: HostBatch,
    shape: StepShape,
    carried_slots: torch.Tensor | None,
) -> PerHeadBatch:
    """The relocated rows' calls (``index``: their batch rows, in order; ``pages``: theirs), vectorised
    over the batch: their rows of the page store go first, in this order, and get room for the step's
    tokens in one ``append``; each layer's lengths and table are views of the step's [layers, ...] ones.
    ``carried_slots``: each row's slot of the scores its policy carries (policies that accumulate attention),
    else None."""
    heads, num_layers = shape.num_kv_heads, shape.num_layers
    store.arrange(pages)
    req_ids = [batch.req_ids[i] for i in index.tolist()]
    rows = len(pages)
    qsl = batch.query_start_loc
    first = qsl[index].astype(np.int64)
    query_lens = qsl[index + 1] - first
    slots = store.append(np.arange(rows), query_lens)  # [layers, virtual tokens]
    if (query_lens == 1).all():  # decode: a token per row, a one-token sequence per (row, head)
        token_idx = first
        token_of, head_of = np.repeat(first, heads), np.tile(np.arange(heads), rows)
        query_start_loc = torch.arange(rows * heads + 1, dtype=torch.int32)
    else:
        ends = np.cumsum(query_lens)
        token_idx = np.repeat(first - (ends - query_lens), query_lens) + np.arange(int(ends[-1]))
        entry, head_of, nth = virtual_tokens(query_lens, heads)
        token_of = first[entry] + nth
        query_start_loc = torch.zeros(rows * heads + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.from_numpy(np.cumsum(np.repeat(query_lens, heads)))
    lengths = np.empty((num_layers, rows * heads), dtype=store.lengths.dtype)  # this step's, a copy
    lengths.reshape(num_layers, rows, heads)[...] = store.lengths[:, :rows]
    seq_lens = torch.from_numpy(lengths)
    tables = torch.from_numpy(store.tables)[:, : rows * heads]
    token_idx = torch.from_numpy(token_idx)
    # A one-head plan depends on the lengths and query layout only (``Planner``): a layer whose lengths
    # are the layer before's (every layer, under a policy that keeps the same per head) shares its plan.
    as_before = np.zeros(num_layers, dtype=bool)
    alike = np.flatnonzero(lengths[1:, 0] == lengths[:-1, 0]) + 1  # layers whose first lengths agree
    as_before[alike] = (lengths[alike] == lengths[alike - 1]).all(axis=1)
    layers, plan = [], None
    for layer_lens, table, same in zip(seq_lens.unbind(0), tables.unbind(0), as_before.tolist()):
        if not same:
            plan = shape.heads_plan(query_start_loc, layer_lens, table)
        layers.append(AttentionBatch(token_idx, query_start_loc, layer_lens, table, 1, plan))
    whole_batch = token_idx.numel() == rows == int(qsl[-1])  # one token per row, every row
    return PerHeadBatch(
        token_idx,
        HeadRows(torch.from_numpy(token_of), torch.from_numpy(head_of), whole_batch),
        layers,
        torch.from_numpy(slots),
        req_ids,
        store,
        seq_lens=seq_lens,
        tables=tables,
        carried_slots=carried_slots,
    )
