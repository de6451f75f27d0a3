"""The CPU backend: vLLM's CPU attention plus kvpolicy's step, registered over ``CPU_ATTN``.

Sibling of ``cuda_backend.py``: both attach the step that their builder's
``StepBuilder`` makes to their platform's metadata, and both mix
``KVPolicyAttention`` into their platform's impl; only the ops differ
(``KVPOLICY_OPS``, default ``cpu``).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from kvpolicy.vllm.internals import CPU_ATTN_MODULE
from kvpolicy.vllm.worker.attention import KVPolicyAttention
from kvpolicy.vllm.worker.modes.base import StepShape
from kvpolicy.vllm.worker.ops import ops_name
from kvpolicy.vllm.worker.step import Step
from kvpolicy.vllm.worker.step_builder import KVPolicyMetadataBuilder

_cpu_attn = importlib.import_module(CPU_ATTN_MODULE)
#: Set to 1 (with ``KVPOLICY_OPS=triton``) to run decode batches in fixed shapes on CPU (``fixed_decode_rows``).
FIXED_DECODE_ENV = "KVPOLICY_FIXED_DECODE"


def uses_triton() -> bool:
    """Whether this backend runs kvpolicy's Triton kernels (interpreted on CPU) instead of vLLM's CPU kernels."""
    return ops_name("cpu") == "triton"


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
        if uses_triton():
            from kvpolicy.vllm.worker.ops.triton import TritonOps

            self.ops = TritonOps()
        else:
            from kvpolicy.vllm.worker.ops.cpu import CPUOps

            self.ops = CPUOps(self)

    def fixed_decode_rows(self) -> int:
        """None: the CPU platform has no CUDA graphs. ``KVPOLICY_FIXED_DECODE=1`` with the Triton ops runs
        decode batches in the fixed shapes a GPU's full graphs replay, to test them end to end."""
        if os.environ.get(FIXED_DECODE_ENV) == "1" and uses_triton():
            return self.vllm_config.scheduler_config.max_num_seqs
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
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if uses_triton():
            from kvpolicy.vllm.worker.ops.triton import TritonOps

            TritonOps.check_impl(self)
