"""Entry point ``vllm.general_plugins: kvpolicy``: loaded by vLLM in every process."""

from __future__ import annotations

CPU_BACKEND_CLS = "kvpolicy.vllm.worker.cpu_backend.KVPolicyCPUBackend"
CUDA_BACKEND_CLS = "kvpolicy.vllm.worker.cuda_backend.KVPolicyTritonBackend"
_registered = False


def register() -> None:
    """Install the kv_* options (per request too: a boolean stays one), kvpolicy's connector by name, the KV
    sizing of bounded policies and the platform's kvpolicy backend. Idempotent."""
    global _registered
    if _registered:
        return
    from kvpolicy.vllm.internals import (
        XARGS_REQUEST_MODELS,
        AttentionBackendEnum,
        current_platform,
        name_connector,
        register_backend,
    )
    from kvpolicy.vllm.patches import keep_request_booleans
    from kvpolicy.vllm.startup.admission import patch_kv_memory_check
    from kvpolicy.vllm.startup.args import CONNECTOR_MODULE, CONNECTOR_NAME, patch_engine_args

    patch_engine_args()
    keep_request_booleans(XARGS_REQUEST_MODELS)
    name_connector(CONNECTOR_NAME, CONNECTOR_MODULE)
    patch_kv_memory_check()
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND_CLS)
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.TRITON_ATTN, CUDA_BACKEND_CLS)
    _registered = True
