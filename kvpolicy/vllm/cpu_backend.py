"""The CPU backend: vLLM's CPU attention plus kvpolicy's step, registered over ``CPU_ATTN``.

Sibling of ``cuda_backend.py``: both attach the step that ``StepBuilder``
makes to their platform's metadata, and both mix ``KVPolicyAttention`` into
their platform's impl; only the ops differ (``KVPOLICY_OPS``, default ``cpu``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kvpolicy.vllm.attention import KVPolicyAttention
from kvpolicy.vllm.internals import CPU_ATTN_MODULE
from kvpolicy.vllm.ops import ops_name
from kvpolicy.vllm.step import Step
from kvpolicy.vllm.step_builder import StepBuilder

_cpu_attn = importlib.import_module(CPU_ATTN_MODULE)


def make_ops(impl=None, builder=None):
    """The ops this backend runs: vLLM's CPU kernels, or kvpolicy's Triton kernels (interpreted on CPU)."""
    if ops_name("cpu") == "triton":
        from kvpolicy.vllm.ops.triton import TritonOps

        return TritonOps(impl)
    from kvpolicy.vllm.ops.cpu import CPUOps

    return CPUOps(impl, builder)


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


class KVPolicyCPUMetadataBuilder(_cpu_attn.CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.ops = ops = make_ops(builder=self)
        self.steps = StepBuilder(
            num_layers=vllm_config.model_config.get_num_layers(vllm_config.parallel_config),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            block_size=self.block_size,
            max_model_len=vllm_config.model_config.max_model_len,
            plan=ops.plan,
            sums_prompts=ops.sums_prompts,
        )

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.is_cross_attention or self.is_encoder_only_attention:
            return metadata
        step = self.steps.build(common_attn_metadata)
        if step is None:
            return metadata
        self.ops.stage(step)
        return KVPolicyCPUMetadata(**vars(metadata), step=step)


class KVPolicyCPUImpl(KVPolicyAttention, _cpu_attn.CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_ops(make_ops(impl=self))
