"""Shared fixtures: the prepared default model (built once, offline).

Without a GPU, kvpolicy's Triton kernels run in Triton's interpreter: the flag
is read when a kernel is defined, so it is set here, before any test module
imports ``kvpolicy_triton``.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Set by pytest-xdist in each worker process (``make test`` runs two: ``-n 2 --dist loadfile``).
XDIST_WORKER_ENV = "PYTEST_XDIST_WORKER"
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def pytest_configure(config):
    """Each test worker runs on a core of its own, and so do the engines it starts: vLLM's own binding
    would put every engine on the same core (its ``auto`` binding reserves the others)."""
    worker = os.environ.get(XDIST_WORKER_ENV)
    if worker is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.environ.setdefault(THREADS_BIND_ENV, str(core))
    os.sched_setaffinity(0, {core})


@pytest.fixture(scope="session")
def model_path() -> Path:
    from kvpolicy.offline.model import prepare

    return prepare()
