"""The KV connector: kvpolicy's channel between workers and the scheduler.

It loads and saves nothing; vLLM's scheduler stays in charge. Workers hand the scheduler the blocks compressed
requests no longer need, with their counters and memory snapshot as connector stats (``metrics.py``). The
scheduler tells workers which prompt blocks others read or the prefix cache holds, takes the blocks a relocated
request keeps out of the prefix cache (when the step's report comes, or when the step is scheduled under vLLM's
asynchronous scheduler: ``rewrite_bounds.py``), frees only the positions a step had (``BlockReleases.seen``), and
admits a request only if the blocks compressed ones will grow into stay free (``reservations.py``). Why each:
docs/architecture.md, "The connector" and "Asynchronous scheduling".
"""

from __future__ import annotations

from typing import Any

from kvpolicy.config import KVPolicyConfig
from kvpolicy.paging import write_order
from kvpolicy.vllm.internals import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    block_sharing,
    held_blocks,
    release_blocks_except,
    stop_caching,
)
from kvpolicy.vllm.messages import BlockReleases, KVPolicyConnectorMetadata
from kvpolicy.vllm.metrics import PER_REQUEST, KVPolicyPromMetrics, KVPolicyStats
from kvpolicy.vllm.patches import reserve_for_admissions
from kvpolicy.vllm.scheduler.request_modes import RequestModes
from kvpolicy.vllm.scheduler.reservations import GrowingRequest, blocks_to_read, blocks_to_reserve
from kvpolicy.vllm.scheduler.rewrite_bounds import RewriteBound
from kvpolicy.vllm.scheduler.rewrite_history import RELOCATIONS
from kvpolicy.vllm.worker.state import WorkerState


class KVPolicyConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        # Scheduler side: requests whose prompt is being read (or not moved yet, see above), and relocated ones.
        self._reading: dict[str, Any] = {}
        self._moves_after_prompt = False
        self._config: KVPolicyConfig | None = None
        self._relocated: dict[str, Any] = {}
        self._max_model_len = vllm_config.model_config.max_model_len
        self._block_size = vllm_config.cache_config.block_size
        # Under vLLM's asynchronous scheduler, the blocks a step may rewrite leave the prefix cache when
        # the step is scheduled (rewrite_bounds.py); under its synchronous one, those the report names.
        self._rewrites: RewriteBound | None = None
        # Each request's policy and its mode's rules (with a kvpolicy configuration).
        self._modes: RequestModes | None = None
        # Worker side: the worker's state, bound by the worker hook (``bind_worker``).
        self._worker: WorkerState | None = None

    def bind_worker(self, worker: WorkerState) -> None:
        """The worker's kvpolicy state, whose releases and counters this connector reports."""
        self._worker = worker

    # Scheduler side: no external KV, nothing to load.
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        config = self._config = KVPolicyConfig.stored_in(self._vllm_config.additional_config)
        if config is not None and config.reserve_growth:
            reserve_for_admissions(kv_cache_manager, self.growth_blocks)
        self._moves_after_prompt = config is not None and config.moves_after_prompt
        vllm_config = self._vllm_config
        if config is not None:
            model, parallel = vllm_config.model_config, vllm_config.parallel_config
            self._modes = RequestModes(
                config, model.get_num_kv_heads(parallel), model.get_num_layers(parallel), self._block_size
            )
        if config is not None and config.rewrites_blocks and vllm_config.scheduler_config.async_scheduling:
            self._rewrites = RewriteBound(self._modes)

    def growth_blocks(self, admitting=None, admitted_tokens: int = 0) -> int:
        """Blocks to keep free for compressed requests' growth up to their ``max_tokens`` (``blocks_to_reserve``),
        and for those still in vLLM's layout (in ``_reading``, their prompt read or not, and the one being
        admitted with slots for ``admitted_tokens``): the blocks they take until their first decode pass, or
        until their prompt is read and after it (``_still_to_take``). A request decode compresses takes at
        most the blocks vLLM appends between two of its passes."""
        growing, decoding = [], 0
        for req_id, request in self._relocated.items():
            held = held_blocks(self._kv_cache_manager, req_id)
            if held is None:  # preempted
                continue
            passes = self._modes.decode_passes(request)
            if passes is not None:
                decoding += passes.blocks_between_passes(self._block_size)
                continue
            growing.append(GrowingRequest(*held, request.num_tokens, max(self._final(request) - request.num_tokens, 0)))
        for req_id, request in self._reading.items():
            held = held_blocks(self._kv_cache_manager, req_id)
            if held is not None:
                decoding += self._still_to_take(request, held[1])
        if admitting is not None:
            decoding += self._still_to_take(admitting, -(-admitted_tokens // self._block_size))
        return blocks_to_reserve(growing, self._block_size) + decoding

    def _final(self, request) -> int:
        return min(request.num_prompt_tokens + request.max_tokens, self._max_model_len)

    def _still_to_take(self, request, table: int) -> int:
        """Blocks a request in vLLM's layout takes past the ``table`` it has: until its first decode pass (a
        prompt within its budget); or, while its prompt is read, the rest of it and, once the read's rewrite
        keeps fewer, what it appends (``blocks_to_read``)."""
        passes = self._modes.decode_passes(request)
        if passes is not None:
            return max(passes.blocks_at_first_pass(self._final(request), self._block_size) - table, 0)
        if request.num_computed_tokens >= request.num_tokens:
            return 0
        kept = self._modes.kept_after_reading(request)
        if kept is None:
            return 0
        return blocks_to_read(request.num_tokens, kept, self._final(request), table, self._block_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._reading[request.request_id] = request
        if self._rewrites is not None:
            self._rewrites.done.discard(request.request_id)  # a preempted request's new blocks cache again

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """Which blocks of each prompt being read are shared or cached, when prefix caching is on; under
        the asynchronous scheduler, the blocks this step may rewrite leave the prefix cache now."""
        RELOCATIONS.next_step()
        manager = self._kv_cache_manager
        caching = manager is not None and manager.enable_caching
        sharing = {}
        for req_id, request in list(self._reading.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id)
            if request.num_computed_tokens >= request.num_prompt_tokens and not self._moves_after_prompt:
                del self._reading[req_id]
            elif caching and scheduled:
                shared, cached = block_sharing(manager, req_id)
                if shared or cached:
                    sharing[req_id] = (shared, cached)
                if self._rewrites is not None:
                    num_blocks = -(-(request.num_computed_tokens + scheduled) // self._block_size)
                    order = write_order(num_blocks, shared, cached)
                    rewritten = self._rewrites.positions(request, scheduled, order)
                    if rewritten:
                        stop_caching(manager, req_id, set(rewritten))
        return KVPolicyConnectorMetadata(sharing)

    def request_finished(self, request, block_ids):
        self._reading.pop(request.request_id, None)
        self._relocated.pop(request.request_id, None)
        if self._rewrites is not None:
            self._rewrites.done.discard(request.request_id)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        releases = connector_output.kv_connector_worker_meta
        if isinstance(releases, BlockReleases):
            for req_id, keep in releases.keep.items():
                RELOCATIONS.record(req_id)
                request = self._reading.pop(req_id, None) or self._relocated.get(req_id)
                if request is not None:
                    self._relocated[req_id] = request
                if self._kv_cache_manager.enable_caching:
                    stop_caching(self._kv_cache_manager, req_id, keep)
                release_blocks_except(self._kv_cache_manager, req_id, keep, releases.seen[req_id])

    # Worker side: attention runs in our backend; nothing to load or save per layer.
    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def build_connector_worker_meta(self) -> BlockReleases | None:
        """After the step's forward: every layer is relocated, so tail blocks can go."""
        return None if self._worker is None else self._worker.take_releases()

    def get_kv_connector_stats(self) -> KVPolicyStats | None:
        worker = self._worker
        if worker is None:  # the scheduler's side counts nothing
            return None
        report = worker.take_report()
        if worker.tp_rank or worker.pipeline_rank:
            # Every rank and stage sees the same requests and blocks: those counts come from the first only.
            report = {key: value for key, value in report.items() if key not in PER_REQUEST}
        return KVPolicyStats(data=report) if report else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPolicyStats:
        return KVPolicyStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVPolicyPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
