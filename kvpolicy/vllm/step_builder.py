"""Builds each step's ``Step`` from vLLM's batch, once per step, for every platform.

A platform's metadata builder calls ``StepBuilder.build`` after its own
``build`` and attaches the result to its metadata; the builder never touches a
tensor of the cache. The one platform-specific thing it needs, how the ops will
run an attention call, comes in as a ``Planner``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvpolicy.config import REQUEST_BUDGET_KEY, REQUEST_POLICY_KEY
from kvpolicy.paging import OffloadedRequest, OffloadPlan, PageCopies, RequestPages, SharedPages, stock_slots
from kvpolicy.policies import Mode
from kvpolicy.vllm.internals import host_batch_tensors
from kvpolicy.vllm.state import WORKER_STATE
from kvpolicy.vllm.step import (
    AttentionBatch,
    ContextSelection,
    HeadRows,
    OffloadedBatch,
    PerHeadBatch,
    Planner,
    RelocatingStep,
    Relocation,
    SelectingStep,
    SharedBatch,
    SharingStep,
    Step,
    SummedChunk,
    WindowStash,
)


@dataclass(frozen=True)
class HostBatch:
    """The parts of vLLM's batch a step is built from, read from the runner's host copies (no device sync)."""

    num_reqs: int
    req_ids: list[str]
    query_start_loc: np.ndarray
    seq_lens: torch.Tensor
    block_table: torch.Tensor

    @classmethod
    def of(cls, cam, runner) -> HostBatch:
        num_reqs = cam.num_reqs
        seq_lens, block_table = host_batch_tensors(cam, runner)
        return cls(
            num_reqs,
            runner.input_batch.req_ids[:num_reqs],
            cam.query_start_loc_cpu[: num_reqs + 1].numpy(),
            seq_lens,
            block_table,
        )


class StepBuilder:
    """The step of a batch: which rows go per head, which relocate, which select; their calls' arguments."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        block_size: int,
        max_model_len: int,
        plan: Planner,
        sums_prompts: bool = False,
    ):
        """``sums_prompts``: the ops attend H2O/D2O prompt chunks themselves (``KVOps.prompt_attention``)."""
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.queries_per_kv = num_heads // num_kv_heads
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.plan = plan
        self.sums_prompts = sums_prompts

    def build(self, cam) -> Step | None:
        """``cam``: vLLM's ``CommonAttentionMetadata`` of the step. None: every row takes the stock path."""
        mode = WORKER_STATE.mode
        if mode is Mode.SELECT:
            return self._selecting(HostBatch.of(cam, WORKER_STATE.runner))
        if mode is Mode.SHARE:
            return self._sharing(HostBatch.of(cam, WORKER_STATE.runner))
        if mode is Mode.RELOCATE:
            return self._relocating(HostBatch.of(cam, WORKER_STATE.runner))
        return None

    def _relocating(self, batch: HostBatch) -> RelocatingStep:
        runner = WORKER_STATE.runner
        num_reqs, qsl, block_table = batch.num_reqs, batch.query_start_loc, batch.block_table
        seq_lens = batch.seq_lens.numpy()
        per_head_rows, relocations, stash, summed, summed_rows = [], [], [], [], []
        policy = WORKER_STATE.policy
        for row, req_id in enumerate(batch.req_ids):
            query_len = int(qsl[row + 1] - qsl[row])
            seq_len = int(seq_lens[row])
            start = seq_len - query_len
            num_blocks = -(-seq_len // self.block_size)
            request = runner.requests[req_id]
            prompt_len = request.num_prompt_tokens
            pages = WORKER_STATE.requests.get(req_id)
            if pages is not None and start == 0:
                # Preempted and recomputed from scratch: compression is redone.
                WORKER_STATE.forget([req_id])
                pages = None
            extra = request.sampling_params.extra_args or {}
            if query_len == 0 or extra.get(REQUEST_POLICY_KEY) == "none" or req_id in WORKER_STATE.uncompressed:
                continue
            if pages is None and start >= prompt_len:
                continue
            budget = WORKER_STATE.config.budget_for(prompt_len, extra.get(REQUEST_BUDGET_KEY))
            if pages is not None:
                pages.add_blocks(block_table[row, len(pages.blocks) : num_blocks].tolist())
                per_head_rows.append((row, req_id, pages, query_len))
                reading = start < prompt_len
                evicts = policy.evicts_while_reading if reading else policy.evicts_in_decode
                if evicts and self._evicts_now(req_id, pages, query_len, reading):
                    done = reading and prompt_len <= seq_len
                    read = None if reading and not done else seq_len
                    relocations.append(_relocation(req_id, extra, pages, None, None, None, done, read))
                continue
            if budget is None and policy.needs_budget:
                continue  # short prompt: stays on the stock path
            window_idx = _window_tokens(int(qsl[row]), start, seq_len, prompt_len)
            if self.sums_prompts and policy.needs_queries and window_idx.numel() == query_len:
                # A chunk of prompt tokens only: attended with its column sums, no queries to keep.
                heads = torch.arange(self.num_kv_heads)
                slots = stock_slots(block_table[row], self.num_kv_heads, self.block_size, torch.arange(seq_len), heads)
                summed.append(SummedChunk(req_id, window_idx, slots))
                summed_rows.append(row)
                window_idx = window_idx[:0]
            reading = seq_len < request.num_tokens  # the prompt (after a preemption: prompt and output)
            if reading and not (policy.evicts_while_reading and seq_len > budget):
                if window_idx.numel():
                    stash.append(WindowStash(req_id, window_idx))
                continue
            chooses = seq_len if reading else prompt_len
            order, shared = WORKER_STATE.writable_blocks(req_id, num_blocks)
            if shared and not self._has_room(
                order, WORKER_STATE.policy_named(extra.get(REQUEST_POLICY_KEY)), budget, chooses
            ):
                WORKER_STATE.leave_uncompressed(req_id)
                continue
            layer_base = WORKER_STATE.page_space().layer_base if WORKER_STATE.pools_layers else None
            pages = RequestPages(
                self.num_layers,
                self.num_kv_heads,
                self.block_size,
                block_table[row, :num_blocks].tolist(),
                order,
                layer_base,
            )
            WORKER_STATE.requests[req_id] = pages
            read = None if reading else seq_len
            relocations.append(
                _relocation(req_id, extra, pages, chooses, seq_len, budget, not reading, read, window_idx)
            )
        step = RelocatingStep(relocations=relocations, window_stash=stash, summed=summed)
        if per_head_rows:
            step.per_head = self._per_head_batch(per_head_rows, qsl)
        if per_head_rows or summed:
            away = {row for row, _, _, _ in per_head_rows} | set(summed_rows)
            step.stock = self._stock_batch(sorted(set(range(num_reqs)) - away), batch)
        return step

    def _has_room(self, order: list[int], policy, budget: int | None, num_tokens: int) -> bool:
        """Whether the blocks relocation may write (``order``: not those other requests read) hold the
        most a layer can keep, and a spare block."""
        heads = self.num_kv_heads
        pages = -(-policy.layer_token_bound(budget, num_tokens, heads) // self.block_size) + heads
        return len(order) * heads >= pages + heads

    @functools.cached_property
    def _keeps_distant_keys(self) -> np.ndarray:
        """[layers, heads]: PoD's (layer, head) pairs that are the lowest of their block."""
        return np.array(WORKER_STATE.policy.layer_groups().keeps_distant_keys())

    def _sharing(self, batch: HostBatch) -> SharingStep | None:
        """PoD: decode rows of laid-out requests attend on the sharing path; a request whose computed
        tokens are all in the cache this step, with a page's worth of distant tokens, is laid out
        after the step's last layer (its blocks past the layout go back to vLLM). With prefix caching
        the layout writes only its own blocks (``write_order``); a prompt whose own blocks cannot hold
        it stays on the stock path."""
        runner = WORKER_STATE.runner
        policy = WORKER_STATE.policy
        qsl, seq_lens = batch.query_start_loc, batch.seq_lens.numpy()
        decoding, layouts = [], []
        for row, req_id in enumerate(batch.req_ids):
            query_len = int(qsl[row + 1] - qsl[row])
            seq_len = int(seq_lens[row])
            num_blocks = -(-seq_len // self.block_size)
            pages = WORKER_STATE.requests.get(req_id)
            if pages is not None and seq_len == query_len:
                WORKER_STATE.forget([req_id])  # preempted and recomputed from scratch
                pages = None
            extra = runner.requests[req_id].sampling_params.extra_args or {}
            if query_len == 0 or extra.get(REQUEST_POLICY_KEY) == "none" or req_id in WORKER_STATE.uncompressed:
                continue
            if pages is not None:
                if query_len != 1:
                    raise RuntimeError("a PoD request takes one new token per step once it is laid out")
                pages.add_blocks(batch.block_table[row, len(pages.blocks) : num_blocks].tolist())
                decoding.append((row, pages))
                continue
            start, end = policy.distant_range(seq_len)
            if seq_len < runner.requests[req_id].num_tokens or end - start < self.block_size:
                continue  # a prompt chunk, or too few distant tokens to free a page
            space = WORKER_STATE.page_space()
            blocks = batch.block_table[row, :num_blocks].tolist()
            order, shared = WORKER_STATE.writable_blocks(req_id, num_blocks)
            pages = SharedPages(
                space.layer_base, self.num_kv_heads, self.block_size, blocks, self._keeps_distant_keys, order
            )
            if shared and pages.blocks_needed(seq_len, (start, end)) > len(order):
                WORKER_STATE.leave_uncompressed(req_id)
                continue
            layouts.append(pages.layout(seq_len, (start, end)))
            WORKER_STATE.requests[req_id] = pages
            WORKER_STATE.relocated_this_step[req_id] = (True, seq_len)
        if not (decoding or layouts):
            return None
        away = {row for row, _ in decoding}
        step = SharingStep(self._stock_batch(sorted(set(range(batch.num_reqs)) - away), batch), layouts=layouts)
        if decoding:
            heads = self.num_kv_heads
            token_idx = torch.tensor([int(qsl[row]) for row, _ in decoding], dtype=torch.int64)
            slots = torch.stack([pages.append() for _, pages in decoding], dim=1)  # [layers, rows, heads]
            step.shared = SharedBatch(
                token_idx,
                HeadRows(
                    token_idx.repeat_interleave(heads),
                    torch.arange(heads).repeat(len(decoding)),
                    len(decoding) == int(qsl[-1]),
                ),
                [pages for _, pages in decoding],
                slots.reshape(self.num_layers, -1),
            )
        return step

    @functools.cached_property
    def _source_layers(self) -> list[int | None]:
        return WORKER_STATE.policy.source_layers(self.num_layers)

    def _selecting(self, batch: HostBatch) -> SelectingStep | None:
        """OmniKV: decode rows whose context is over their budget attend sparsely in the sparse layers;
        with ``--kv-offload``, prompts over budget move their sparse layers to the host pool."""
        runner = WORKER_STATE.runner
        config = WORKER_STATE.config
        num_reqs, qsl = batch.num_reqs, batch.query_start_loc
        seq_lens = batch.seq_lens.numpy()
        rows, budgets, offloaded_rows, offloads = [], [], [], []
        for row, req_id in enumerate(batch.req_ids):
            request = runner.requests[req_id]
            seq_len = int(seq_lens[row])
            query_len = int(qsl[row + 1] - qsl[row])
            offloaded = WORKER_STATE.offloaded.get(req_id)
            if offloaded is not None and seq_len == query_len:
                WORKER_STATE.forget([req_id])  # preempted and recomputed from scratch
                offloaded = None
            extra = request.sampling_params.extra_args or {}
            if extra.get(REQUEST_POLICY_KEY) == "none":
                continue  # full attention in every layer, like a prompt chunk
            budget = config.sparse_budget(seq_len, self.num_layers, extra.get(REQUEST_BUDGET_KEY))
            if offloaded is not None:
                if query_len != 1:
                    raise RuntimeError("an offloaded request takes one new token per step")
                offloaded_rows.append((row, offloaded, budget))
                continue
            decoding = query_len == 1 and request.num_prompt_tokens < seq_len == request.num_tokens
            if not decoding:
                if WORKER_STATE.offloads and seq_len == request.num_tokens and budget < seq_len:
                    offload = self._offload(req_id, batch.block_table[row], seq_len, budget)
                    if offload is not None:
                        offloads.append(offload)
                continue  # prompt (or recompute) chunks: full attention
            if budget < seq_len:
                rows.append(row)
                budgets.append(budget)
        if not (rows or offloaded_rows or offloads):
            return None
        context = None
        if rows:
            row_idx = torch.tensor(rows, dtype=torch.int64)
            context = ContextSelection(
                token_idx=torch.from_numpy(qsl[rows].astype(np.int64)),
                seq_lens=batch.seq_lens[row_idx],
                block_table=batch.block_table[row_idx],
                budgets=budgets,
                plan=self._rows_plan,
            )
        away = {row for row, _, _ in offloaded_rows}
        stock_rows = sorted(set(range(num_reqs)) - set(rows) - away)
        step = SelectingStep(
            sources=self._source_layers, stock=self._stock_batch(stock_rows, batch), context=context, offloads=offloads
        )
        if offloaded_rows:
            step.offloaded = self._offloaded_batch(offloaded_rows, batch)
            step.resident = self._stock_batch(sorted(set(range(num_reqs)) - away), batch)
        return step

    def _rows_plan(self, query_start_loc, seq_lens, block_table):
        return self.plan(query_start_loc, seq_lens, block_table, self.num_kv_heads, self.queries_per_kv)

    def _heads_plan(self, query_start_loc, seq_lens, block_table):
        return self.plan(query_start_loc, seq_lens, block_table, 1, self.queries_per_kv)

    def _offload(self, req_id: str, block_table, length: int, budget: int) -> OffloadPlan | None:
        """Plan the offload of a prompt that completes this step; None when the host pool is full, or
        when with prefix caching its own blocks cannot hold what stays on the device."""
        space = WORKER_STATE.page_space()
        num_blocks = -(-length // self.block_size)
        order, _ = WORKER_STATE.writable_blocks(req_id, num_blocks)
        request = OffloadedRequest(
            space.layer_base,
            self.num_kv_heads,
            self.block_size,
            block_table[:num_blocks].tolist(),
            [source is None for source in self._source_layers],
            order,
        )
        staging = -(-budget // self.block_size) - 1
        if request.blocks_needed(length, staging) > len(order):
            WORKER_STATE.counters["shared_prefix_uncompressed"] += 1
            return None
        try:
            plan = request.offload(length, WORKER_STATE.host_pool(), staging, self.max_model_len)
        except MemoryError:
            WORKER_STATE.counters["offload_refused"] += 1
            return None
        WORKER_STATE.offloaded[req_id] = request
        WORKER_STATE.offloaded_this_step[req_id] = plan.keep_blocks
        return plan

    def _offloaded_batch(self, rows, batch: HostBatch) -> OffloadedBatch:
        heads, qsl = self.num_kv_heads, batch.query_start_loc
        host = WORKER_STATE.host_pool()
        slots, flushes = [], []
        for row, request, _ in rows:
            num_blocks = -(-(request.length + 1) // self.block_size)
            request.add_blocks(batch.block_table[row, len(request.blocks) : num_blocks].tolist())
            row_slots, row_flushes = request.append(host)
            slots.append(row_slots)
            flushes.append(row_flushes)
        token_idx = torch.tensor([int(qsl[row]) for row, _, _ in rows], dtype=torch.int64)
        requests = [request for _, request, _ in rows]
        query_start_loc = torch.arange(len(rows) * heads + 1, dtype=torch.int32)
        seq_lens = torch.tensor([r.length for r in requests], dtype=torch.int32).repeat_interleave(heads)
        full = {}
        for layer, source in enumerate(self._source_layers):
            if source is None:
                table = padded_table([pages for request in requests for pages in request.full_table(layer)])
                full[layer] = AttentionBatch(
                    token_idx, query_start_loc, seq_lens, table, 1, self._heads_plan(query_start_loc, seq_lens, table)
                )
        return OffloadedBatch(
            token_idx=token_idx,
            rows=HeadRows(
                token_idx.repeat_interleave(heads), torch.arange(heads).repeat(len(rows)), len(rows) == int(qsl[-1])
            ),
            requests=requests,
            budgets=[budget for _, _, budget in rows],
            slots=torch.stack(slots, dim=1).reshape(self.num_layers, -1),
            flushes=[PageCopies.cat([row[layer] for row in flushes]) for layer in range(self.num_layers)],
            full=full,
            plan=self._heads_plan,
        )

    def _evicts_now(self, req_id: str, pages: RequestPages, query_len: int, reading: bool) -> bool:
        """An evicting policy compresses at every prompt chunk over budget, and in decode once some
        layer is a page's worth over its budget (then every layer over budget is brought back to it)."""
        lengths = pages.lengths
        if (lengths != lengths[:, :1]).any():
            raise RuntimeError("a policy that evicts must keep the same count in every head of a layer")
        over = lengths[:, 0] + query_len - np.asarray(WORKER_STATE.carried[req_id].budgets)
        return over.max() > 0 if reading else over.max() >= self.block_size

    def _per_head_batch(self, rows, qsl) -> PerHeadBatch:
        heads = self.num_kv_heads
        token_idx = torch.cat([torch.arange(int(qsl[row]), int(qsl[row]) + q) for row, _, _, q in rows])
        token_of, head_of, slots = [], [], []
        for row, _, pages, query_len in rows:
            tokens = torch.arange(int(qsl[row]), int(qsl[row]) + query_len)
            token_of.append(tokens.repeat(heads))
            head_of.append(torch.arange(heads).repeat_interleave(query_len))
            slots.append(pages.append(query_len).transpose(0, 2, 1).reshape(self.num_layers, -1))  # [layers, H*q]
        query_lens = torch.tensor([query_len for _, _, _, query_len in rows]).repeat_interleave(heads)
        query_start_loc = torch.zeros(query_lens.numel() + 1, dtype=torch.int32)
        query_start_loc[1:] = query_lens.cumsum(0)
        lengths = np.stack([pages.lengths for _, _, pages, _ in rows], axis=1).reshape(self.num_layers, -1)
        lengths = lengths.astype(np.int32)
        all_seq_lens = torch.from_numpy(lengths)
        width = max(pages.max_pages() for _, _, pages, _ in rows)
        tables = torch.from_numpy(np.concatenate([pages.page_table(width) for _, _, pages, _ in rows], axis=1))
        layers, by_lengths = [], {}
        for layer in range(self.num_layers):
            seq_lens = all_seq_lens[layer]
            key = lengths[layer].tobytes()  # a one-head plan depends on lengths only (``Planner``)
            if key not in by_lengths:
                by_lengths[key] = self._heads_plan(query_start_loc, seq_lens, tables[layer])
            layers.append(AttentionBatch(token_idx, query_start_loc, seq_lens, tables[layer], 1, by_lengths[key]))
        whole_batch = token_idx.numel() == len(rows) == int(qsl[-1])  # one token per row, every row
        return PerHeadBatch(
            token_idx,
            HeadRows(torch.cat(token_of), torch.cat(head_of), whole_batch),
            layers,
            torch.from_numpy(np.concatenate(slots, axis=1)),
            [req_id for _, req_id, _, _ in rows],
        )

    def _stock_batch(self, rows, batch: HostBatch) -> AttentionBatch:
        qsl = batch.query_start_loc
        query_lens = [int(qsl[row + 1] - qsl[row]) for row in rows]
        token_idx = torch.cat(
            [torch.arange(int(qsl[row]), int(qsl[row + 1])) for row in rows] or [torch.zeros(0, dtype=torch.int64)]
        )
        query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        row_idx = torch.tensor(rows, dtype=torch.int64)
        seq_lens = batch.seq_lens[row_idx]
        table = batch.block_table[row_idx]
        return AttentionBatch(
            token_idx,
            query_start_loc,
            seq_lens,
            table,
            self.num_kv_heads,
            self._rows_plan(query_start_loc, seq_lens, table),
        )


def _relocation(
    req_id, extra, pages, num_tokens, num_computed, budget, prompt_done, read, window_idx=None
) -> Relocation:
    """``read``: the request's length once this step is done, if its prompt is then read whole."""
    WORKER_STATE.relocated_this_step[req_id] = (prompt_done, read)
    if window_idx is None:
        window_idx = torch.zeros(0, dtype=torch.int64)
    policy = WORKER_STATE.policy_named(extra.get(REQUEST_POLICY_KEY))
    return Relocation(req_id, policy, pages, num_tokens, num_computed, budget, window_idx)


def _window_tokens(first_token: int, start: int, end: int, prompt_len: int) -> torch.Tensor:
    """Batch indices of this chunk's tokens whose queries the policy scores with.

    The observation window (the last ``window`` prompt tokens), or every
    prompt token for policies that accumulate attention over the prompt.
    """
    policy = WORKER_STATE.policy
    if policy.needs_queries:
        window = prompt_len
    elif policy.needs_window:
        window = WORKER_STATE.config.window
    else:
        return torch.zeros(0, dtype=torch.int64)
    window_start = max(prompt_len - window, start)
    window_end = max(min(end, prompt_len), window_start)
    return torch.arange(first_token + window_start - start, first_token + window_end - start)


def padded_table(rows: list[list[int]]) -> torch.Tensor:
    """A block table with one row per virtual sequence, zero-padded to the longest."""
    table = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int32)
    for i, pages in enumerate(rows):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table
