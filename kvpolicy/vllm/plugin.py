"""Entry point ``vllm.general_plugins: kvpolicy``: loaded by vLLM in every process."""

from __future__ import annotations

BACKEND_CLS = "kvpolicy.vllm.backend.KVPolicyCPUBackend"
_registered = False


def register() -> None:
    """Install the kv_* options, the KV sizing of bounded policies and the per-head backend. Idempotent."""
    global _registered
    if _registered:
        return
    from kvpolicy.vllm.admission import patch_kv_memory_check
    from kvpolicy.vllm.args import patch_engine_args
    from kvpolicy.vllm.internals import AttentionBackendEnum, current_platform, register_backend

    patch_engine_args()
    patch_kv_memory_check()
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CLS)
    _registered = True
