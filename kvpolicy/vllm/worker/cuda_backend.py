"""The CUDA backend: vLLM's Triton attention plus kvpolicy's step, registered over ``TRITON_ATTN``.

Sibling of ``cpu_backend.py``: stock rows and steps with no kvpolicy work run vLLM's own Triton attention
(``super()``); per-head and selection rows run kvpolicy's Triton kernels through the builder's ``TritonOps``,
whose attention calls vLLM's FlashAttention 3 in fp16/bf16 on compute capability 9.x (``ops/flash_varlen.py``).
For a policy whose decode has no host work after attention (the SnapKV family, streaming, identity) the builder
reports full CUDA-graph support and decode runs in fixed shapes (``modes/fixed_decode.py``); for the others it
reports none, and vLLM keeps piecewise graphs around eager attention (``--enforce-eager`` is never needed).
With ``--kv-policy none`` the backend is vLLM's, graphs included.

kvpolicy runs on vLLM's V1 model runner (``startup/args.py``), not the V2 one plain vLLM picks on CUDA: the worker
reads the V1 runner's requests, input batch and KV caches, and wraps its CUDA-graph dispatcher; V2 keeps them in
other structures (``vllm/v1/worker/gpu/``). What V1 costs plain vLLM is measured beside it in the GPU window
(``benchmarks/gpu/throughput_sweep.py``: the ``vllm-v1`` row at the same batch as ``vllm-default``).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

from kvpolicy.config import KVPolicyConfig
from kvpolicy.policies import POLICIES
from kvpolicy.vllm.internals import TRITON_ATTN_MODULE, AttentionCGSupport, full_decode_graph_rows
from kvpolicy.vllm.worker.attention import KVPolicyAttention
from kvpolicy.vllm.worker.modes import fixed_decode
from kvpolicy.vllm.worker.modes.base import StepShape
from kvpolicy.vllm.worker.ops.triton import TritonOps
from kvpolicy.vllm.worker.step import Step
from kvpolicy.vllm.worker.step_builder import KVPolicyMetadataBuilder

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


class KVPolicyTritonMetadataBuilder(KVPolicyMetadataBuilder, _triton_attn.TritonAttentionMetadataBuilder):
    metadata_cls = KVPolicyTritonMetadata

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        config = KVPolicyConfig.stored_in(vllm_config.additional_config)
        if config is None or not config.changes_attention:
            return super().get_cudagraph_support(vllm_config, kv_cache_spec)
        why_not = fixed_decode.refusal(POLICIES[config.policy], config.offload is not None)
        if why_not is None:
            model, parallel = vllm_config.model_config, vllm_config.parallel_config
            max_seqs = vllm_config.scheduler_config.max_num_seqs
            size = fixed_decode.buffer_bytes(
                model.get_num_layers(parallel), model.get_num_kv_heads(parallel), max_seqs,
                model.max_model_len, kv_cache_spec.block_size,
            )  # fmt: skip
            if size > fixed_decode.MAX_BUFFER_BYTES:
                why_not = f"its decode buffers would take {size >> 20} MiB (lower --max-num-seqs or --max-model-len)"
        if why_not is None:
            logger.info("--kv-policy %s: decode batches run in full CUDA graphs, other steps piecewise", config.policy)
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        logger.warning(
            "--kv-policy %s: attention runs outside CUDA graphs (%s); the rest of the model keeps piecewise "
            "CUDA graphs",
            config.policy,
            why_not,
        )
        return AttentionCGSupport.NEVER

    def fixed_decode_rows(self) -> int:
        return full_decode_graph_rows(self.vllm_config)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.ops = TritonOps()

    def step_shape(self) -> StepShape:
        return StepShape(
            num_layers=self.num_layers,
            num_kv_heads=self.num_heads_kv,
            queries_per_kv=self.num_heads_q // self.num_heads_kv,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            plan=self.ops.plan,
        )


class KVPolicyTritonImpl(KVPolicyAttention, _triton_attn.TritonAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        TritonOps.check_impl(self)
