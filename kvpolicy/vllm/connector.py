"""The KV connector: kvpolicy's channel between workers and the scheduler, and its metrics.

It loads and saves nothing (no KV delivery); vLLM's own scheduler stays in
charge. Workers report what they relocated through connector stats, which
vLLM aggregates across ranks and hands to ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpolicy.paging import OffloadedRequest, RequestPages
from kvpolicy.vllm.args import stored_config
from kvpolicy.vllm.internals import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    release_blocks_from,
)
from kvpolicy.vllm.state import WORKER_STATE

#: stats key -> (Prometheus name, help)
COUNTERS = {
    "relocated_requests": (
        "vllm:kvpolicy_relocated_requests",
        "Requests whose prompt KV the policy moved into per-(layer, kv-head) pages.",
    ),
    "compressed_requests": (
        "vllm:kvpolicy_compressed_requests",
        "Relocated requests that kept fewer prompt tokens than they had.",
    ),
    "released_blocks": (
        "vllm:kvpolicy_released_blocks",
        "vLLM KV blocks handed back to the block pool after compression.",
    ),
    "released_bytes": (
        "vllm:kvpolicy_released_bytes",
        "Bytes of KV cache handed back to vLLM after compression (all layers).",
    ),
    "eviction_passes": (
        "vllm:kvpolicy_eviction_passes",
        (
            "Compressions of a request before its prompt completes (keydiff: each chunk) or after it"
            " (keydiff, h2o, d2o: each page's worth of tokens over budget in decode)."
        ),
    ),
    "prompt_kv_tokens": (
        "vllm:kvpolicy_prompt_kv_tokens",
        "Prompt tokens times layers times KV heads of relocated requests, before compression.",
    ),
    "kept_kv_tokens": (
        "vllm:kvpolicy_kept_kv_tokens",
        "Of those, the (token, layer, KV head) entries kept; kept / prompt is the compression ratio.",
    ),
    "held_kv_pages": (
        "vllm:kvpolicy_held_kv_pages",
        "One-head pages (blocks kept x layers x KV heads) compressed requests hold right after compression.",
    ),
    "ideal_kv_pages": (
        "vllm:kvpolicy_ideal_kv_pages",
        "Kept tokens / block size: the pages a perfect allocator would hold; ideal / held is memory efficiency.",
    ),
    "offloaded_requests": (
        "vllm:kvpolicy_offloaded_requests",
        "omnikv --kv-offload: requests whose sparse layers moved to the host pool when their prompt completed.",
    ),
    "offloaded_kv_pages": (
        "vllm:kvpolicy_offloaded_kv_pages",
        "omnikv --kv-offload: one-head pages copied to the host pool (at offload, and each filled tail page).",
    ),
    "loaded_kv_pages": (
        "vllm:kvpolicy_loaded_kv_pages",
        "omnikv --kv-offload: one-head pages copied from the host pool to staging for a sparse layer to read.",
    ),
    "offload_refused": (
        "vllm:kvpolicy_offload_refused",
        "omnikv --kv-offload: requests kept whole in vLLM's pool because the host pool was full.",
    ),
    "context_pages": (
        "vllm:kvpolicy_context_pages",
        "omnikv: context pages of decode rows at each filter-layer selection (what full attention would read).",
    ),
    "selected_pages": (
        "vllm:kvpolicy_selected_pages",
        "omnikv: of those, the pages selected for the sparse layers; selected / context is the fraction they read.",
    ),
}

#: stats key -> (Prometheus name, help): the largest value seen, not a sum
PEAKS = {
    "peak_request_kv_blocks": (
        "vllm:kvpolicy_peak_request_kv_blocks",
        "The most vLLM KV blocks one relocated request held at once (measured before each compression).",
    ),
}


class KVPolicyConnectorMetadata(KVConnectorMetadata):
    """Nothing flows scheduler -> worker yet; the type marks a bound step."""


@dataclass
class BlockReleases(KVConnectorWorkerMetadata):
    """Worker -> scheduler: relocated requests need only their first ``keep_blocks[req]`` blocks."""

    keep_blocks: dict[str, int]

    def aggregate(self, other: "BlockReleases") -> "BlockReleases":
        # Tensor-parallel ranks hold different heads: keep what the fullest rank needs.
        for req_id, keep in other.keep_blocks.items():
            self.keep_blocks[req_id] = max(keep, self.keep_blocks.get(req_id, 0))
        return self


@dataclass
class KVPolicyStats(KVConnectorStats):
    """Counter increments since the last report, summed across workers and steps; peaks take the max."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVPolicyStats":
        for key, value in other.data.items():
            combine = max if key in PEAKS else sum
            self.data[key] = combine((self.data.get(key, 0), value))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVPolicyPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        config = stored_config(vllm_config.additional_config)
        policy = config.policy if config else "none"
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, documentation) in COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=documentation, labelnames=labelnames + ["policy"])
            self._counters[key] = {
                engine: counter.labels(*values, policy) for engine, values in per_engine_labelvalues.items()
            }

        self._peaks: dict[str, dict[int, Any]] = {}
        self._peak_values: dict[tuple[str, int], float] = {}
        for key, (name, documentation) in PEAKS.items():
            gauge = self._gauge_cls(
                name=name, documentation=documentation, labelnames=labelnames + ["policy"], multiprocess_mode="max"
            )
            self._peaks[key] = {
                engine: gauge.labels(*values, policy) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)
            elif key in self._peaks and value > self._peak_values.get((key, engine_idx), 0):
                self._peak_values[key, engine_idx] = value
                self._peaks[key][engine_idx].set(value)


def _release_tail(request: RequestPages | OffloadedRequest, keep: int, counters) -> None:
    """A request stops using its blocks from ``keep`` on; count them, and the most it held before."""
    counters["peak_request_kv_blocks"] = max(counters["peak_request_kv_blocks"], request.live_blocks())
    released = request.release_tail(keep)
    counters["released_blocks"] += released
    counters["released_bytes"] += released * WORKER_STATE.block_bytes


class KVPolicyConnector(KVConnectorBase_V1):
    # Scheduler side: no external KV, nothing to load.
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVPolicyConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def update_connector_output(self, connector_output) -> None:
        releases = connector_output.kv_connector_worker_meta
        if isinstance(releases, BlockReleases):
            for req_id, keep in releases.keep_blocks.items():
                release_blocks_from(self._kv_cache_manager, req_id, keep)

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
        keep_blocks = {}
        counters = WORKER_STATE.counters
        for req_id, prompt_done in WORKER_STATE.relocated_this_step.items():
            pages = WORKER_STATE.requests.get(req_id)
            if pages is None:
                continue
            keep = keep_blocks[req_id] = pages.blocks_needed()
            _release_tail(pages, keep, counters)
            if not prompt_done:
                counters["eviction_passes"] += 1
                continue
            counters["relocated_requests"] += 1
            counters["kept_kv_tokens"] += pages.kept_tokens()
            prompt_len = WORKER_STATE.runner.requests[req_id].num_prompt_tokens
            prompt_tokens = prompt_len * pages.num_layers * pages.num_heads
            counters["prompt_kv_tokens"] += prompt_tokens
            counters["compressed_requests"] += pages.kept_tokens() < prompt_tokens
            counters["held_kv_pages"] += keep * pages.num_layers * pages.num_heads
            counters["ideal_kv_pages"] += pages.kept_tokens() / pages.block_size
        WORKER_STATE.relocated_this_step.clear()
        for req_id, keep in WORKER_STATE.offloaded_this_step.items():
            request = WORKER_STATE.offloaded.get(req_id)
            if request is None:
                continue
            keep_blocks[req_id] = keep
            _release_tail(request, keep, counters)
        WORKER_STATE.offloaded_this_step.clear()
        return BlockReleases(keep_blocks) if keep_blocks else None

    def get_kv_connector_stats(self) -> KVPolicyStats | None:
        counters = WORKER_STATE.take_counters()
        return KVPolicyStats(data=counters) if counters else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPolicyStats:
        return KVPolicyStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVPolicyPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
