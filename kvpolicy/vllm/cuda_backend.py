"""The CUDA backend: vLLM's Triton attention plus kvpolicy's step, registered over ``TRITON_ATTN``.

Sibling of ``cpu_backend.py``: stock rows and steps with no kvpolicy work run
vLLM's own Triton attention (``super()``); per-head and selection rows run
kvpolicy's Triton kernels through ``TritonOps``. The per-head step is built on
the host every step (page tables change as policies relocate), so while a
policy changes attention the builder reports no CUDA graph support for
attention: vLLM then keeps piecewise CUDA graphs for everything else and runs
attention eagerly between them (it logs that choice); ``--enforce-eager`` is
not needed. With ``--kv-policy none`` the backend is vLLM's, graphs included.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

from kvpolicy.vllm.args import stored_config
from kvpolicy.vllm.attention import KVPolicyAttention
from kvpolicy.vllm.internals import TRITON_ATTN_MODULE, AttentionCGSupport
from kvpolicy.vllm.ops.triton import TritonOps
from kvpolicy.vllm.step import Step
from kvpolicy.vllm.step_builder import StepBuilder

_triton_attn = importlib.import_module(TRITON_ATTN_MODULE)
logger = logging.getLogger(__name__)


@dataclass
class KVPolicyTritonMetadata(_triton_attn.TritonAttentionMetadata):
    step: Step | None = None


class KVPolicyTritonBackend(_triton_attn.TritonAttentionBackend):
    """Keeps its platform's name so vLLM treats it as its Triton backend."""

    @staticmethod
    def get_impl_cls():
        return KVPolicyTritonImpl

    @staticmethod
    def get_builder_cls():
        return KVPolicyTritonMetadataBuilder


class KVPolicyTritonMetadataBuilder(_triton_attn.TritonAttentionMetadataBuilder):
    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        config = stored_config(vllm_config.additional_config)
        if config is None or not config.changes_attention:
            return super().get_cudagraph_support(vllm_config, kv_cache_spec)
        logger.warning(
            "--kv-policy %s: attention runs outside CUDA graphs (its per-head page tables are rebuilt on "
            "the host each step); the rest of the model keeps piecewise CUDA graphs",
            config.policy,
        )
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model_config = vllm_config.model_config
        self.ops = TritonOps()
        self.steps = StepBuilder(
            num_layers=model_config.get_num_layers(vllm_config.parallel_config),
            num_heads=model_config.get_num_attention_heads(vllm_config.parallel_config),
            num_kv_heads=kv_cache_spec.num_kv_heads,
            block_size=kv_cache_spec.block_size,
            max_model_len=model_config.max_model_len,
            plan=self.ops.plan,
        )

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        step = self.steps.build(common_attn_metadata)
        if step is None:
            return metadata
        self.ops.stage(step)
        return KVPolicyTritonMetadata(**vars(metadata), step=step)


class KVPolicyTritonImpl(KVPolicyAttention, _triton_attn.TritonAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_ops(TritonOps(self))
