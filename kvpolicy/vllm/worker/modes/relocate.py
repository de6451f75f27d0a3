"""Relocate: a policy that keeps some tokens per KV head (the SnapKV family, streaming, keydiff, h2o, d2o,
identity) moves a request's prompt into per-head pages, and its rows then attend per head.

``Relocate`` builds each step from vLLM's batch (``per_head_path.PerHeadPath`` runs it in every layer);
``Relocate.plan`` is the mode's rule for both processes: when a step relocates a request and how many of
its blocks it writes. A prompt within its budget is relocated once decode takes its cache past the budget
(``decode_passes.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Any

import numpy as np
import torch

from kvpolicy.paging import PageStore, RequestPages, relocation_blocks, stock_slots
from kvpolicy.policies import Schedule
from kvpolicy.vllm.messages import BlockRelease
from kvpolicy.vllm.worker.modes.base import HostBatch, ModeState, RequestStep, Row, StepShape
from kvpolicy.vllm.worker.modes.carried import CarriedScores, CarriedState
from kvpolicy.vllm.worker.modes.decode_passes import DecodePasses, decode_form, decode_passes_of
from kvpolicy.vllm.worker.modes.fixed_decode import FixedDecode, refusal
from kvpolicy.vllm.worker.modes.per_head_batch import per_head_batch
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.ops.staging import TableMirror
from kvpolicy.vllm.worker.state import WorkerState
from kvpolicy.vllm.worker.step import (
    FixedDecodeStep,
    RelocatingStep,
    Relocation,
    SummedChunk,
    WindowStash,
)


@dataclass
class RelocatedRequest:
    """One request of a relocating policy, from its first prompt chunk on.

    While its prompt is read: the observation-window queries of earlier chunks (``window_queries``,
    layer -> chunks) and, for policies that accumulate attention, the running column sums of summed
    chunks (``column_sums``, layer -> [q_heads, keys so far]; ``summed_queries``: how many of the
    stashed queries, first, are in them, for a policy that reads both). At relocation, for policies
    that budget across layers, what each layer observed until the last one arrives (``observed``). Once relocated:
    its per-head ``pages``, and what an evicting policy carries to its next pass (``carried``).
    ``uncompressed``: it stays on the stock path: its own blocks could not hold what the policy keeps, or
    its prompt is within budget and nothing compresses it in decode. ``decode``: when decode compresses a
    prompt within its budget (its first pass relocates it).
    """

    pages: RequestPages | None = None
    window_queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    column_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    summed_queries: int = 0
    observed: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)
    carried: CarriedState | None = None
    uncompressed: bool = False
    decode: DecodePasses | None = None


#: What ``Relocate._decoding_rows`` reads of every row's request: a request not tracked reads as a new one.
_UNTRACKED = RelocatedRequest()
_PAGES, _UNCOMPRESSED, _BLOCKS = attrgetter("pages"), attrgetter("uncompressed"), attrgetter("blocks")
_DECODE = attrgetter("decode")


@dataclass
class _Draft:
    """A relocating step as the builder collects it: the relocated rows that attend per head (their batch
    rows and pages, in any order: sorted at the end), the rest row by row."""

    step: RelocatingStep = field(default_factory=RelocatingStep)
    per_head_rows: list[int] = field(default_factory=list)
    per_head_pages: list[RequestPages] = field(default_factory=list)
    summed_rows: list[int] = field(default_factory=list)


def _last_prompt_positions(row: Row, window: int) -> tuple[int, int]:
    """The positions of a row's chunk among its prompt's last ``window``: ``start`` to ``end`` (empty if none)."""
    start = max(row.prompt_len - window, row.start)
    return start, max(min(row.seq_len, row.prompt_len), start)


@dataclass(frozen=True)
class RelocationPlan:
    """``Relocate.plan`` of one request in one step."""

    budget: int | None
    chooses: int | None = None  # tokens chosen among when the step relocates; None: the prompt reads on
    blocks: int = 0  # of the request's own blocks, those the relocation writes


class Relocate(ModeState[RelocatedRequest]):
    """The relocating policies' requests, from their first prompt chunk on, and the builder of their steps.
    ``store``: the page tables of every relocated request, rows of batch-wide arrays; ``scores``: what
    H2O and D2O carry of them, rows of one tensor per layer; ``device_tables``: the store's tables where
    the ops run, kept up to date by each step's staging."""

    store: PageStore | None = None
    scores: CarriedScores | None = None
    #: The buffers of fixed-shape decode steps, when the platform runs decode in full CUDA graphs.
    fixed: FixedDecode | None = None

    def __init__(self, worker: WorkerState):
        super().__init__(worker)
        self.device_tables = TableMirror()

    def enable_fixed_decode(self, ops: KVOps, shape: StepShape, max_rows: int, head_size: int, device) -> bool:
        if self.pools_layers or refusal(self.policy, self.worker.config.offload is not None) is not None:
            return False
        if self.fixed is None:  # one set of buffers for the worker, however many builders bind to it
            self.fixed = FixedDecode(self, ops, shape, max_rows, head_size, device)
        return True

    def decode_work_due(self, rows: Iterable[tuple[str, Any, int]]) -> bool:
        """Whether a decode row of the step, (request id, the runner's request, tokens in its cache after the
        step), stashes its query or runs a pass (``DecodePasses``): host work after attention, which a full
        CUDA graph leaves out, so the step runs outside one (as a prompt step does)."""
        for req_id, runner_request, end in rows:
            request = self.requests.get(req_id, _UNTRACKED)
            decode = request.decode
            name = Row(0, req_id, runner_request, 0, 1, end).policy_name
            if decode is None and request.pages is None and not request.uncompressed and name != "none":
                policy, block_size = self.worker.policy_named(name), self.fixed.shape.block_size
                decode = self.decode_passes(
                    RequestStep.of(policy, self.worker.config, runner_request, end, 1, 1, 1, block_size)
                )
            if decode is not None and decode.repeats and (decode.due(end) or decode.observes(end)):
                return True
        return False

    def stage(self, step: RelocatingStep | FixedDecodeStep, ops: KVOps) -> None:
        ops.stage(step, self.device_tables)
        if isinstance(step, FixedDecodeStep):
            self.fixed.fill(step, self.device_tables)

    def new_request(self) -> RelocatedRequest:
        return RelocatedRequest()

    def pages_of(self, request: RelocatedRequest) -> RequestPages | None:
        return request.pages

    def dropped(self, request: RelocatedRequest) -> None:
        if request.pages is not None:
            request.pages.close()
        if request.carried is not None:
            self.scores.release(request.carried.slot)

    def new_pages(self, blocks: list[int], order: list[int] | None, layer_base, shape: StepShape) -> RequestPages:
        """A relocated request's pages, a row of the worker's page store (made with the first)."""
        if self.store is None:
            self.store = PageStore(shape.num_layers, shape.num_kv_heads, shape.block_size, layer_base is not None)
        args = (shape.num_layers, shape.num_kv_heads, shape.block_size, blocks, order, layer_base)
        return RequestPages(*args, store=self.store)

    # What the per-head path reads and keeps of a request between layers and steps.

    @property
    def pools_layers(self) -> bool:
        """Whether a relocated request's layers share one pool of pages: vLLM's whole KV buffer as one
        page space, the CPU layout (``--kv-page-pool``)."""
        return self.worker.config.page_pool != "layer" and self.worker.runner.kv_caches[0].device.type == "cpu"

    def relocated_cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache relocated requests' page ids index: the whole buffer when their layers share a pool."""
        return self.worker.page_space().pages if self.pools_layers else kv_cache

    def stash_window(self, req_id: str, layer: int, queries: torch.Tensor) -> None:
        """Keep a chunk's window queries [tokens, q_heads, head_dim] (a copy: the step's query buffer is
        reused) where they are, on the cache's device: the policy scores them there."""
        self.track(req_id).window_queries.setdefault(layer, []).append(queries)

    def take_window(self, req_id: str, layer: int, last: torch.Tensor) -> torch.Tensor:
        """All window queries of a prompt for one layer, [q_heads, window, head_dim], on their device; in
        decode, the last ``window`` of them, those the next pass reads again left stashed."""
        request = self.requests[req_id]
        window = torch.cat([*request.window_queries.pop(layer, []), last])
        decode = request.decode
        if decode is not None:
            window = window[-decode.window :]
            if decode.kept_queries:
                request.window_queries[layer] = [window[-decode.kept_queries :]]
        return window.transpose(0, 1)

    def add_column_sums(self, req_id: str, layer: int, sums: torch.Tensor) -> None:
        """Add a summed chunk's column sums [q_heads, keys so far] to the prompt's running ones of a layer."""
        layers = self.track(req_id).column_sums
        earlier = layers.get(layer)
        if earlier is not None:
            sums[:, : earlier.shape[1]] += earlier  # this chunk saw every earlier key, and its own
        layers[layer] = sums

    def take_column_sums(self, req_id: str, layer: int, length: int) -> torch.Tensor | None:
        """A layer's running column sums of the prompt, zero-padded to ``length`` keys; None if no chunk was summed."""
        sums = self.requests[req_id].column_sums.pop(layer, None)
        if sums is None:
            return None
        return torch.nn.functional.pad(sums, (0, length - sums.shape[1]))

    def observe(self, req_id: str, layer: int, kv_cache: torch.Tensor, observation: Any) -> dict:
        """Record a layer's cache and observation of a prompt; all layers so far, emptied once the last arrives."""
        request = self.requests[req_id]
        observed = request.observed
        observed[layer] = (kv_cache, observation)
        if len(observed) == request.pages.num_layers:
            request.observed = {}
        return observed

    def carried(self, req_id: str) -> CarriedState:
        """What the request's evicting policy carries, made at its first compression."""
        request = self.requests[req_id]
        if request.carried is None:
            if self.scores is None:
                self.scores = CarriedScores(request.pages.num_layers)
            request.carried = CarriedState.empty(request.pages.num_layers, self.scores.new_slot())
        return request.carried

    # The builder.

    def build(self, batch: HostBatch, shape: StepShape) -> RelocatingStep:
        """Rows of relocated requests go per head (running eviction passes when due); a prompt that completes
        this step (or, for a policy that evicts while reading, a chunk over budget) relocates after
        attention; chunks before it stash their window queries or, for H2O/D2O on ops that can, are
        attended with their column sums."""
        draft = _Draft()
        schedule = self.policy.schedule
        rest = self._decoding_rows(draft, batch, shape, schedule)
        for row in self.rows(batch, rest):
            request = self.requests.get(row.req_id)
            if row.idle or (request is not None and request.uncompressed):
                continue
            if request is not None and request.pages is not None:
                self._relocated_row(draft, row, request.pages, batch, shape, schedule)
            elif row.start < row.prompt_len:
                self._prompt_row(draft, row, batch, shape)
            elif row.query_len == 1:
                self._decode_row(draft, row, batch, shape)
        if draft.per_head_rows:
            index = np.asarray(draft.per_head_rows, dtype=np.int64)
            pages = draft.per_head_pages
            if rest is not None and (index[1:] < index[:-1]).any():  # rows found both ways: batch order
                order = np.argsort(index, kind="stable")
                index, pages = index[order], [pages[i] for i in order]
            carried = None
            if self.policy.inputs.new_token_attention:  # where each row's accumulated scores are
                carried = torch.tensor([self.requests[batch.req_ids[i]].carried.slot for i in index.tolist()])
            draft.step.per_head = per_head_batch(self.store, index, pages, batch, shape, carried)
        step = draft.step
        if self.fixed is not None:  # a decode batch runs in fixed shapes (vLLM may replay a full graph)
            fixed = self.fixed.step_of(step, batch)
            if fixed is not None:
                return fixed
        if draft.per_head_rows or draft.summed_rows:
            step.stock = shape.stock_batch(batch, draft.per_head_rows + draft.summed_rows)
            step.platform_layout_tokens = torch.cat([step.stock.token_idx, *(c.token_idx for c in step.summed)])
        return step

    def _decoding_rows(self, draft: _Draft, batch: HostBatch, shape: StepShape, schedule: Schedule) -> list[int] | None:
        """Under a policy that never evicts after relocation, a relocated request's row only needs room for
        its tokens (and the pages of blocks vLLM appended): those rows go per head here, found for the whole
        batch without a ``Row`` each (but those decode compresses, ``RelocatedRequest.decode``). Returns the other rows, for ``rows``; None: every row (an evicting
        policy, checked row by row). A tracked request never asked for ``kv_policy: none`` (``rows`` yields
        no such row), and one read again from its first token is left to ``rows``, which forgets it."""
        if schedule.per_chunk or schedule.in_decode:
            return None
        # C-level maps over the batch: a row costs no Python bytecode until the rows needing blocks.
        tracked = list(map(self.requests.get, batch.req_ids, repeat(_UNTRACKED)))
        held = list(map(_PAGES, tracked))
        relocated = np.fromiter(map(is_not, held, repeat(None)), dtype=bool, count=len(held))
        relocated &= ~np.fromiter(map(_UNCOMPRESSED, tracked), dtype=bool, count=len(held))
        relocated &= np.fromiter(map(is_, map(_DECODE, tracked), repeat(None)), dtype=bool, count=len(held))
        index = np.flatnonzero(relocated)
        if not index.size:
            return None
        qsl = batch.query_start_loc
        query_lens = qsl[index + 1] - qsl[index]
        seq_lens = batch.seq_lens.numpy()[index]
        decoding = np.flatnonzero((query_lens > 0) & (seq_lens > query_lens))
        fast_rows = index[decoding]
        fast = fast_rows.tolist()
        pages = list(map(held.__getitem__, fast))
        known = np.fromiter(map(len, map(_BLOCKS, pages)), dtype=np.int64, count=len(pages))
        num_blocks = shape.num_blocks(seq_lens[decoding])
        appended = num_blocks - known  # blocks vLLM appended, added for every row with as many at once
        for count in np.unique(appended[appended > 0]).tolist():
            adding = np.flatnonzero(appended == count)
            positions = torch.from_numpy(known[adding][:, None] + np.arange(count))
            new_blocks = batch.block_table[torch.from_numpy(fast_rows[adding])[:, None], positions]
            RequestPages.add_new_blocks([pages[i] for i in adding.tolist()], new_blocks.numpy().astype(np.int64))
        draft.per_head_rows.extend(fast)
        draft.per_head_pages.extend(pages)
        requests = len(batch.req_ids)  # rows past them are a full CUDA graph's padding: no request
        if len(fast) == requests:
            return []
        taken = set(fast)
        return [i for i in range(requests) if i not in taken]

    def _relocated_row(
        self, draft: _Draft, row: Row, pages: RequestPages, batch: HostBatch, shape: StepShape, schedule: Schedule
    ) -> None:
        """A relocated request attends per head; an evicting policy runs a pass over it when it is over budget."""
        num_blocks = shape.num_blocks(row.seq_len)
        if num_blocks > len(pages.blocks):
            pages.add_blocks(batch.block_table[row.index, len(pages.blocks) : num_blocks].tolist())
        draft.per_head_rows.append(row.index)
        draft.per_head_pages.append(pages)
        reading = row.start < row.prompt_len
        evicts = schedule.per_chunk if reading else schedule.in_decode
        if evicts and self._evicts_now(row, pages, reading, shape):
            done = reading and row.prompt_len <= row.seq_len
            self._relocate(draft, row, pages, prompt_done=done, length=None if reading and not done else row.seq_len)
            return
        decode = self.requests[row.req_id].decode
        if decode is None or not decode.repeats or reading or row.query_len != 1:
            return
        token = torch.arange(row.first_token, row.first_token + 1)
        if decode.due(row.seq_len):
            self._relocate(draft, row, pages, prompt_done=False, length=row.seq_len, window_idx=token, decode=True)
        elif decode.observes(row.seq_len):
            draft.step.window_stash.append(WindowStash(row.req_id, token))

    def _decode_row(self, draft: _Draft, row: Row, batch: HostBatch, shape: StepShape) -> None:
        """A decode row of a request still in vLLM's layout: a prompt within its budget, which decode
        compresses (``DecodePasses``): its query is stashed in the steps before its first pass, which
        relocates it. Any other such row stays on the stock path."""
        request = self.track(row.req_id)
        if request.decode is None:
            request.decode = self.decode_passes(self.request_step(row, shape))
            if request.decode is None:
                request.uncompressed = True
                return
        decode = request.decode
        token = torch.arange(row.first_token, row.first_token + 1)
        if not decode.due(row.seq_len):
            if decode.observes(row.seq_len):
                draft.step.window_stash.append(WindowStash(row.req_id, token))
            return
        plan = self.plan(self.request_step(row, shape))
        self._new_pages(draft, row, batch, shape, plan, True, token if decode.window else token[:0])

    def _prompt_row(self, draft: _Draft, row: Row, batch: HostBatch, shape: StepShape) -> None:
        """A chunk of a prompt not relocated yet: summed, stashed, or relocated once it is read (or over budget)."""
        policy = self.policy
        request_step = self.request_step(row, shape)
        plan = self.plan(request_step)
        if plan is None:
            return  # short prompt: stays on the stock path
        window_idx = self._window_tokens(row)
        if shape.sums_prompts and policy.inputs.attention and window_idx.numel() == row.query_len:
            # A chunk of prompt tokens only: attended with its column sums, no queries to keep.
            heads = torch.arange(shape.num_kv_heads)
            positions = torch.arange(row.seq_len)
            slots = stock_slots(batch.block_table[row.index], shape.num_kv_heads, shape.block_size, positions, heads)
            draft.step.summed.append(SummedChunk(row.req_id, window_idx, slots))
            draft.summed_rows.append(row.index)
            in_window = self._summed_window(row)
            self.track(row.req_id).summed_queries += in_window
            window_idx = window_idx[window_idx.numel() - in_window :]
        if plan.chooses is None:  # reading on: the chunk's window queries wait for the relocation
            if window_idx.numel():
                draft.step.window_stash.append(WindowStash(row.req_id, window_idx))
            return
        self._new_pages(draft, row, batch, shape, plan, request_step.complete, window_idx)

    def _new_pages(
        self, draft: _Draft, row: Row, batch: HostBatch, shape: StepShape, plan: RelocationPlan, done: bool, window_idx
    ) -> None:
        """Relocate a request in vLLM's layout into pages of its own blocks after this step's attention
        (``done``: every token it knows is then in the cache), if its blocks others read leave it room."""
        num_blocks = shape.num_blocks(row.seq_len)
        order, shared = self.worker.writable_blocks(row.req_id, num_blocks)
        if shared and len(order) < plan.blocks:
            self.leave_uncompressed(row.req_id)
            return
        layer_base = self.worker.page_space().layer_base if self.pools_layers else None
        blocks = batch.block_table[row.index, :num_blocks].tolist()
        pages = self.new_pages(blocks, order, layer_base, shape)
        self.track(row.req_id).pages = pages
        self._relocate(
            draft,
            row,
            pages,
            prompt_done=done,
            length=row.seq_len if done else None,
            num_tokens=plan.chooses,
            budget=plan.budget,
            window_idx=window_idx,
            decode=self.requests[row.req_id].decode is not None,
        )

    def _relocate(
        self,
        draft: _Draft,
        row: Row,
        pages: RequestPages,
        *,
        prompt_done: bool,
        length: int | None,
        num_tokens: int | None = None,
        budget: int | None = None,
        window_idx: torch.Tensor | None = None,
        decode: bool = False,
    ) -> None:
        """Relocate a prompt after attention (``num_tokens``: those the policy chooses among), or run an
        eviction pass (``num_tokens`` None); ``length``: the request's once the step is done, if its prompt
        is then read whole. ``decode``: a pass of ``DecodePasses`` (the policy in its ``decode_form``)."""
        self.worker.releases[row.req_id] = BlockRelease(pages, length=length, prompt_done=prompt_done)
        policy = self.worker.policy_named(row.policy_name)
        relocation = Relocation(
            req_id=row.req_id,
            policy=decode_form(policy) if decode else policy,
            pages=pages,
            num_tokens=num_tokens,
            num_computed=None if num_tokens is None else row.seq_len,
            budget=budget,
            window_idx=torch.zeros(0, dtype=torch.int64) if window_idx is None else window_idx,
            summed_queries=self.requests[row.req_id].summed_queries,
        )
        draft.step.relocations.append(relocation)

    def _summed_window(self, row: Row) -> int:
        """How many of a summed chunk's last tokens are in the observation window, whose queries a policy
        that reads both is handed too (their attention is in the column sums already)."""
        if not self.policy.inputs.window:
            return 0
        start, end = _last_prompt_positions(row, self.policy.window)
        return end - start

    def _window_tokens(self, row: Row) -> torch.Tensor:
        """Batch indices of this chunk's tokens whose queries the policy scores with.

        The observation window (the last ``window`` prompt tokens), or every
        prompt token for policies that accumulate attention over the prompt.
        """
        if self.policy.inputs.attention:
            window = row.prompt_len
        elif self.policy.inputs.window:
            window = self.policy.window
        else:
            return torch.zeros(0, dtype=torch.int64)
        start, end = _last_prompt_positions(row, window)
        return torch.arange(row.first_token + start - row.start, row.first_token + end - row.start)

    @staticmethod
    def plan(step: RequestStep) -> RelocationPlan | None:
        """The mode's rule: None when the request keeps its whole prompt (no budget: the stock path, until
        a decode step that relocates it: ``decode_passes``); else its budget and, when this step relocates
        it, the tokens the policy chooses among (the prompt once read; the tokens so far for a policy that
        evicts at every chunk over budget, or in decode) and the blocks the relocation writes: the most a
        layer can keep, the output recomputed after a preemption, and a spare block."""
        policy = step.policy
        budget = step.config.budget_for(step.prompt_len, step.budget_arg)
        if budget is None and policy.needs_budget:
            decode = Relocate.decode_passes(step)
            if decode is None or step.query_len != 1 or step.end <= step.prompt_len or not decode.due(step.end):
                return None
            entries = policy.layer_token_bound(decode.budget, step.end, step.num_kv_heads)
            return RelocationPlan(
                decode.budget, step.end, relocation_blocks(entries, step.num_kv_heads, step.block_size)
            )
        reading = not step.complete
        if reading and not (policy.schedule.per_chunk and step.end > budget):
            return RelocationPlan(budget)
        chooses = step.end if reading else step.prompt_len
        heads = step.num_kv_heads
        entries = policy.layer_token_bound(budget, chooses, heads) + heads * max(step.end - chooses, 0)
        return RelocationPlan(budget, chooses, relocation_blocks(entries, heads, step.block_size))

    decode_passes = staticmethod(decode_passes_of)

    @staticmethod
    def written_blocks(step: RequestStep) -> int | None:
        plan = Relocate.plan(step)
        return None if plan is None or plan.chooses is None else plan.blocks

    def _evicts_now(self, row: Row, pages: RequestPages, reading: bool, shape: StepShape) -> bool:
        """An evicting policy compresses at every prompt chunk over budget, and in decode once some
        layer is a page's worth over its budget (then every layer over budget is brought back to it)."""
        lengths = pages.lengths
        if (lengths != lengths[:, :1]).any():
            raise RuntimeError("a policy that evicts must keep the same count in every head of a layer")
        over = lengths[:, 0] + row.query_len - np.asarray(self.requests[row.req_id].carried.budgets)
        return over.max() > 0 if reading else over.max() >= shape.block_size
