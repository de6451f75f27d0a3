"""kvpolicy's Prometheus metrics: what workers count and snapshot each step, and how it reaches ``/metrics``.

Workers report through connector stats, which vLLM aggregates across
tensor-parallel ranks and steps and hands to ``build_prom_metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpolicy.config import KVPolicyConfig
from kvpolicy.vllm.internals import KVConnectorPromMetrics, KVConnectorStats

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
    "shared_prefix_uncompressed": (
        "vllm:kvpolicy_shared_prefix_uncompressed",
        (
            "Prefix caching: prompts left uncompressed because most of their blocks are prefix-cache hits"
            " other running requests read, too few of their own blocks to hold what the policy keeps."
        ),
    ),
    "pod_layouts": (
        "vllm:kvpolicy_pod_layouts",
        "pod: requests laid out over every layer's pages (distant keys kept only in each block's lowest layer).",
    ),
    "pod_distant_evaluated": (
        "vllm:kvpolicy_pod_distant_evaluated",
        "pod: (query head, layer) pairs of decode tokens that could attend to distant tokens with shared scores.",
    ),
    "pod_distant_skipped": (
        "vllm:kvpolicy_pod_distant_skipped",
        "pod --kv-pod-tau: of those, the ones whose proximal gate reached tau, so the distant part was skipped.",
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

#: Counters of requests and blocks, which every tensor-parallel rank sees alike: reported by the first rank
#: only. The others count each rank's own KV heads, and add up across ranks.
PER_REQUEST = frozenset(
    {
        "relocated_requests",
        "compressed_requests",
        "released_blocks",
        "eviction_passes",
        "shared_prefix_uncompressed",
        "pod_layouts",
        "offloaded_requests",
        "offload_refused",
    }
)

#: stats key -> (Prometheus name, help): the largest value seen, not a sum
PEAKS = {
    "peak_request_kv_blocks": (
        "vllm:kvpolicy_peak_request_kv_blocks",
        "The most vLLM KV blocks one relocated request held at once (measured before each compression).",
    ),
}

#: stats key -> (Prometheus name, help, how tensor-parallel ranks combine): the memory saved right now.
#: A request counts while it holds fewer vLLM blocks than its tokens would fill uncompressed.
GAUGES = {
    "requests_compressed_now": (
        "vllm:kvpolicy_num_requests_compressed",
        "Requests in the KV cache now that hold fewer vLLM blocks than their tokens would fill uncompressed.",
        max,
    ),
    "compressed_kv_blocks": (
        "vllm:kvpolicy_compressed_kv_blocks",
        "vLLM KV blocks those requests hold now.",
        max,
    ),
    "compressed_kv_bytes": (
        "vllm:kvpolicy_compressed_kv_bytes",
        "Bytes of KV cache those requests hold now (every layer, every tensor-parallel rank).",
        sum,
    ),
    "uncompressed_kv_bytes": (
        "vllm:kvpolicy_uncompressed_kv_bytes",
        "Bytes those requests would hold uncompressed: their tokens in the cache, in whole blocks.",
        sum,
    ),
    "saved_kv_bytes": (
        "vllm:kvpolicy_saved_kv_bytes",
        "Uncompressed minus compressed bytes: KV memory the policy gives vLLM back right now.",
        sum,
    ),
}


@dataclass
class KVPolicyStats(KVConnectorStats):
    """One step's report: counter increments (summed), peaks (the max) and the latest memory snapshot
    (blocks and requests: the max over ranks, which share block tables; bytes: the sum over ranks)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVPolicyStats:
        for key, value in other.data.items():
            combine = GAUGES[key][2] if key in GAUGES else max if key in PEAKS else sum
            self.data[key] = combine((self.data.get(key, 0), value))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class KVPolicyPromMetrics(KVConnectorPromMetrics):
    """Counters, peak and snapshot gauges, labelled with the server's ``--kv-policy``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        config = KVPolicyConfig.stored_in(vllm_config.additional_config)
        policy = config.policy if config else "none"

        def per_engine(metric) -> dict[int, Any]:
            return {engine: metric.labels(*values, policy) for engine, values in per_engine_labelvalues.items()}

        labels = labelnames + ["policy"]
        self._counters = {
            key: per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labels))
            for key, (name, doc) in COUNTERS.items()
        }
        self._peaks = {
            key: per_engine(self._gauge_cls(name=name, documentation=doc, labelnames=labels, multiprocess_mode="max"))
            for key, (name, doc) in PEAKS.items()
        }
        self._peak_values: dict[tuple[str, int], float] = {}
        self._gauges = {
            key: per_engine(
                self._gauge_cls(name=name, documentation=doc, labelnames=labels, multiprocess_mode="mostrecent")
            )
            for key, (name, doc, _) in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)
            elif key in self._gauges:
                self._gauges[key][engine_idx].set(value)
            elif key in self._peaks and value > self._peak_values.get((key, engine_idx), 0):
                self._peak_values[key, engine_idx] = value
                self._peaks[key][engine_idx].set(value)
