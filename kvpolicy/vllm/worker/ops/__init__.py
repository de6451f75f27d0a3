"""The ops interface (``base.KVOps``) and its implementations: ``cpu`` (vLLM's CPU kernels and kvpolicy's C++
ops), ``triton`` (``triton_kernels/``, with ``flash_varlen``'s FlashAttention on a GPU); ``staging`` holds what the
GPU ops stage each step. Each platform's backend makes its own."""

from __future__ import annotations

from kvpolicy.vllm.worker.ops.base import KVOps

__all__ = ["KVOps"]
