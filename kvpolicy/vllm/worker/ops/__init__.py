"""The ops interface and its implementations; ``KVPOLICY_OPS`` picks one (default: the platform's own)."""

from __future__ import annotations

import os

from kvpolicy.vllm.worker.ops.base import KVOps

#: Environment variable naming the ops a backend uses: ``cpu`` (vLLM's CPU kernels) or ``triton``
#: (``triton_kernels/``; on a CPU machine only with ``TRITON_INTERPRET=1``, for testing the GPU path).
OPS_ENV = "KVPOLICY_OPS"
OPS_NAMES = ("cpu", "triton")


def ops_name(platform_default: str) -> str:
    name = os.environ.get(OPS_ENV, platform_default)
    if name not in OPS_NAMES:
        raise ValueError(f"{OPS_ENV}={name!r}: choose one of {', '.join(OPS_NAMES)}")
    return name


__all__ = ["KVOps", "OPS_ENV", "OPS_NAMES", "ops_name"]
