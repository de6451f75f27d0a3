"""The KV connector: kvpolicy's channel between workers and the scheduler, and its metrics.

It loads and saves nothing (no KV delivery); vLLM's own scheduler stays in
charge. Workers report what they relocated through connector stats, which
vLLM aggregates across ranks and hands to ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpolicy.vllm.args import stored_config
from kvpolicy.vllm.internals import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
)
from kvpolicy.vllm.state import WORKER_STATE

#: stats key -> (Prometheus name, help)
COUNTERS = {
    "relocated_requests": (
        "vllm:kvpolicy_relocated_requests",
        "Requests whose prompt KV the policy moved into per-(layer, kv-head) pages.",
    ),
}


class KVPolicyConnectorMetadata(KVConnectorMetadata):
    """Nothing flows scheduler -> worker yet; the type marks a bound step."""


@dataclass
class KVPolicyStats(KVConnectorStats):
    """Counter increments since the last report; summed across workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVPolicyStats":
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)


class KVPolicyConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._reported_relocations = 0

    # Scheduler side: no external KV, nothing to load.
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVPolicyConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    # Worker side: attention runs in our backend; nothing to load or save per layer.
    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_kv_connector_stats(self) -> KVPolicyStats | None:
        relocated = WORKER_STATE.relocated_requests - self._reported_relocations
        if not relocated:
            return None
        self._reported_relocations = WORKER_STATE.relocated_requests
        return KVPolicyStats(data={"relocated_requests": relocated})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPolicyStats:
        return KVPolicyStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVPolicyPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
