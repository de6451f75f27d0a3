"""The CPU backend: vLLM's CPU attention plus kvpolicy's step, registered over ``CPU_ATTN``.

Sibling of ``cuda_backend.py``: both attach the step that their builder's
``StepBuilder`` makes to their platform's metadata, and both mix
``KVPolicyAttention`` into their platform's impl; only the ops differ
(``make_ops``: vLLM's CPU kernels and kvpolicy's C++ ops).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kvpolicy.vllm.internals import CPU_ATTN_MODULE
from kvpolicy.vllm.worker.attention import KVPolicyAttention
from kvpolicy.vllm.worker.modes.base import StepShape
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.step import Step
from kvpolicy.vllm.worker.step_builder import KVPolicyMetadataBuilder

_cpu_attn = importlib.import_module(CPU_ATTN_MODULE)


@dataclass
class KVPolicyCPUMetadata(_cpu_attn.CPUAttentionMetadata):
    step: Step | None = None


class KVPolicyCPUBackend(_cpu_attn.CPUAttentionBackend):
    """Keeps its platform's name so vLLM treats it as the CPU backend."""

    @staticmethod
    def get_impl_cls():
        return KVPolicyCPUImpl

    @staticmethod
    def get_builder_cls():
        return KVPolicyCPUMetadataBuilder


class KVPolicyCPUMetadataBuilder(KVPolicyMetadataBuilder, _cpu_attn.CPUAttentionMetadataBuilder):
    metadata_cls = KVPolicyCPUMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.ops = self.make_ops()

    def make_ops(self) -> KVOps:
        """vLLM's CPU kernels and kvpolicy's C++ ops. (Engine tests run the GPU's Triton ops here, interpreted,
        by replacing this method: ``tests/e2e/engine_run.py``.)"""
        from kvpolicy.vllm.worker.ops.cpu import CPUOps

        return CPUOps(self)

    def fixed_decode_rows(self) -> int:
        """0: the CPU platform has no CUDA graphs, so no decode step needs a fixed shape."""
        return 0

    def step_shape(self) -> StepShape:
        return StepShape(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            queries_per_kv=self.num_heads // self.num_kv_heads,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            plan=self.ops.plan,
            sums_prompts=self.ops.sums_prompts,
        )


class KVPolicyCPUImpl(KVPolicyAttention, _cpu_attn.CPUAttentionBackendImpl):
    """vLLM's CPU attention impl, with kvpolicy's step before and around it (``KVPolicyAttention``)."""
