"""What every mode shares: the batch it reads, the rows it may change, the calls of the rows the platform
attends as usual, the one place a request's state is created and dropped, and the rule both processes
ask of a mode (``ModeState.written_blocks`` and ``decode_passes`` over a ``RequestStep``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from kvpolicy.config import REQUEST_BUDGET_KEY, REQUEST_DECODE_BUFFER_KEY, REQUEST_POLICY_KEY
from kvpolicy.paging import RequestPages
from kvpolicy.paging.block_pages import BlockPages
from kvpolicy.policies import Policy
from kvpolicy.vllm.internals import host_batch_tensors
from kvpolicy.vllm.worker.modes.decode_passes import DecodePasses
from kvpolicy.vllm.worker.modes.request_step import RequestStep
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.state import WorkerState
from kvpolicy.vllm.worker.step import AttentionBatch, Planner, Step


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


@dataclass(slots=True)
class Row:
    """One row of the batch: a request and this step's tokens of it (made for every row at every step:
    slots, not frozen, for a cheap constructor)."""

    index: int
    req_id: str
    request: Any  # the runner's state of the request
    first_token: int  # its first query token in the batch
    query_len: int
    seq_len: int  # tokens in the cache after this step

    @property
    def start(self) -> int:
        """Tokens in the cache before this step."""
        return self.seq_len - self.query_len

    @property
    def prompt_len(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def extra(self) -> dict:
        return self.request.sampling_params.extra_args or {}

    @property
    def policy_name(self) -> str | None:
        """The request's ``kv_policy``, if it asked for one."""
        return self.extra.get(REQUEST_POLICY_KEY)

    @property
    def budget_arg(self) -> int | None:
        """The request's ``kv_budget``, if it asked for one."""
        return self.extra.get(REQUEST_BUDGET_KEY)

    @property
    def decode_buffer_arg(self) -> int | None:
        """The request's ``kv_decode_buffer``, if it asked for one."""
        return self.extra.get(REQUEST_DECODE_BUFFER_KEY)

    @property
    def idle(self) -> bool:
        return self.query_len == 0


@dataclass(frozen=True)
class StepShape:
    """The model and cache a step is built for, and the ops' planner of its calls."""

    num_layers: int
    num_kv_heads: int
    queries_per_kv: int
    block_size: int
    max_model_len: int
    plan: Planner
    sums_prompts: bool = False  # the ops attend H2O/D2O prompt chunks themselves (``KVOps.prompt_attention``)

    def num_blocks(self, length: int | np.ndarray) -> int | np.ndarray:
        """Blocks that hold ``length`` tokens (elementwise for an array of lengths)."""
        return -(-length // self.block_size)

    def rows_plan(self, query_start_loc, seq_lens, block_table):
        return self.plan(query_start_loc, seq_lens, block_table, self.num_kv_heads, self.queries_per_kv)

    def heads_plan(self, query_start_loc, seq_lens, block_table):
        return self.plan(query_start_loc, seq_lens, block_table, 1, self.queries_per_kv)

    def stock_batch(self, batch: HostBatch, away=()) -> AttentionBatch:
        """The call of every row of the batch but those in ``away`` (distinct rows), in vLLM's layout."""
        if len(away) == batch.num_reqs:  # every row elsewhere (a decode step of relocated requests): no row
            token_idx, query_start_loc = torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
            row_idx = slice(0, 0)
        else:
            kept = np.ones(batch.num_reqs, dtype=bool)
            kept[list(away)] = False
            rows = np.flatnonzero(kept)
            qsl = batch.query_start_loc.astype(np.int64)
            query_lens = qsl[rows + 1] - qsl[rows]
            ends = np.cumsum(query_lens)
            token_idx = torch.from_numpy(
                np.repeat(qsl[rows] - (ends - query_lens), query_lens) + np.arange(ends[-1:].sum())
            )
            query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
            query_start_loc[1:] = torch.from_numpy(ends)
            row_idx = torch.from_numpy(rows)
        seq_lens = batch.seq_lens[row_idx]
        table = batch.block_table[row_idx]
        return AttentionBatch(
            token_idx,
            query_start_loc,
            seq_lens,
            table,
            self.num_kv_heads,
            self.rows_plan(query_start_loc, seq_lens, table),
        )


R = TypeVar("R")


class ModeState(ABC, Generic[R]):
    """One mode's worker side: the state of each of its requests (``R``), made and dropped here only,
    and the builder that turns a batch into its step."""

    def __init__(self, worker: WorkerState):
        self.worker = worker
        self.requests: dict[str, R] = {}

    @property
    def policy(self) -> Policy:
        """The server's policy (read at each use: tests may wrap it)."""
        return self.worker.policy

    @staticmethod
    def written_blocks(step: RequestStep) -> int | None:
        """How many of the request's own blocks (the first of ``write_order``) the step may rewrite after
        its attention; None: it rewrites none. The one rule of the mode for both processes: the worker's
        mode decides with it whether the step relocates, lays out or offloads the request and whether its
        own blocks have room; the scheduler's connector evicts those blocks from the prefix cache when it
        schedules the step (``scheduler/rewrite_bounds.py``)."""
        return None

    @staticmethod
    def decode_passes(step: RequestStep) -> DecodePasses | None:
        """When decode compresses the request (a prompt within its budget); None: never. The scheduler
        reserves from it the blocks the request appends between two passes (``scheduler/connector.py``)."""
        return None

    @staticmethod
    def rewrites_end(step: RequestStep) -> bool:
        """Whether a step that rewrites blocks is the request's last to (until a preemption): the
        scheduler then stops asking about it."""
        return step.complete

    def request_step(self, row: Row, shape: StepShape) -> RequestStep:
        """A batch row as the mode's rule reads it."""
        policy = self.worker.policy_named(row.policy_name)
        return RequestStep.of(policy, self.worker.config, row.request, row.seq_len, row.query_len, shape.num_kv_heads,
                              shape.num_layers, shape.block_size)  # fmt: skip

    def new_request(self) -> R:
        """The state of a request the mode starts to follow at its first use (``track``)."""
        raise NotImplementedError(f"{type(self).__name__} makes each request's state whole, in one place")

    def track(self, req_id: str) -> R:
        """A request's state, made at its first use."""
        request = self.requests.get(req_id)
        if request is None:
            request = self.requests[req_id] = self.new_request()
        return request

    def leave_uncompressed(self, req_id: str) -> None:
        """A prompt whose own blocks cannot hold what its policy keeps stays on the stock path."""
        self.track(req_id).uncompressed = True
        self.worker.counters["shared_prefix_uncompressed"] += 1

    def forget(self, req_id: str) -> None:
        """Drop a finished, preempted or restarted request's state."""
        request = self.requests.pop(req_id, None)
        self.worker.releases.pop(req_id, None)
        if request is not None:
            self.dropped(request)

    def dropped(self, request: R) -> None:
        """What a dropped request's state held outside vLLM's blocks goes back (the host pool)."""

    @abstractmethod
    def pages_of(self, request: R) -> BlockPages | RequestPages | None:
        """The pages a request holds in place of vLLM's blocks, if any."""

    def held_pages(self) -> Iterator[tuple[str, BlockPages | RequestPages]]:
        """Requests holding their own pages (the memory gauges)."""
        for req_id, request in self.requests.items():
            pages = self.pages_of(request)
            if pages is not None:
                yield req_id, pages

    def rows(self, batch: HostBatch, indices: Iterable[int] | None = None) -> Iterator[Row]:
        """The batch's rows the mode may change (of ``indices`` only, if given). A request read again from
        its first token was preempted and is recomputed from scratch: its state is dropped and its
        compression redone. A request that asked for ``kv_policy: none`` stays on the stock path."""
        qsl, seq_lens = batch.query_start_loc, batch.seq_lens.numpy()
        runner_requests = self.worker.runner.requests
        req_ids = batch.req_ids
        for index in range(len(req_ids)) if indices is None else indices:
            req_id = req_ids[index]
            first_token = int(qsl[index])
            row = Row(
                index,
                req_id,
                runner_requests[req_id],
                first_token,
                int(qsl[index + 1]) - first_token,
                int(seq_lens[index]),
            )
            if row.start == 0 and req_id in self.requests:
                self.forget(req_id)
            if row.policy_name != "none":
                yield row

    @abstractmethod
    def build(self, batch: HostBatch, shape: StepShape) -> Step | None:
        """The step of a batch; None when every row takes the stock path."""

    def enable_fixed_decode(self, ops: KVOps, shape: StepShape, max_rows: int, head_size: int, device) -> bool:
        """Run decode batches of up to ``max_rows`` rows in fixed shapes (``fixed_decode.py``), for the
        platform's full CUDA graphs; False: this mode's decode cannot (attention then stays outside graphs)."""
        return False

    def stage(self, step: Step, ops: KVOps) -> None:
        """Hand a built step to the ops that will run it, with the device state the mode keeps for them."""
        ops.stage(step)


class ModePath:
    """How a mode's steps run in each attention layer: over the mode (its requests, the device state it
    keeps, the worker's page space and counters) and the metadata builder's ops."""

    def __init__(self, mode: ModeState, ops: KVOps):
        self.mode = mode
        self.worker = mode.worker
        self.ops = ops

    def layer_index(self, layer) -> int:
        return self.worker.layer_index(layer.layer_name)

    def platform_writes(self, own_rows, platform_tokens, key, platform_write) -> bool:
        """The platform's share of a layer's cache write: every row when the step has none of this path's own
        (``own_rows`` None: returns False, nothing left to write), else the tokens ``platform_tokens``."""
        if own_rows is None:
            platform_write(None)
            return False
        if platform_tokens.numel():  # none in a decode step whose every row is this path's
            platform_write(self.ops.on_device(platform_tokens, key.device))
        return True
