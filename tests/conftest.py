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
    would put every engine on the same core (its ``auto`` binding reserves the others).

    torch sized its thread pool by the cores it saw when it was imported; left at that, its threads share
    the one core and wait on each other (the Triton interpreter's kernel tests ran 6x slower)."""
    worker = os.environ.get(XDIST_WORKER_ENV)
    if worker is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.environ.setdefault(THREADS_BIND_ENV, str(core))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


#: The files whose tests talk to the ``vllm serve`` a test worker starts for its session (``tests/e2e/conftest.py``).
SERVER_FILES = frozenset(
    f"tests/e2e/{name}.py" for name in ("test_server", "test_dashboard", "test_load", "test_vllm_bench")
)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the server's files as one: a worker runs a file's tests, so they share its
    engines, and one worker runs every test of the server, so only it starts one (a start compiles the model,
    about 45 s)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ServerFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "server" if path in SERVER_FILES else path

    return ServerFilesTogether(config, log)


#: The files that start engines and servers: tens of seconds each, where a unit or kernel file takes seconds.
ENGINE_TESTS = "tests/e2e/"


def pytest_collection_modifyitems(items):
    """The engine tests first, so that the quick files fill the end of both workers' runs (with
    ``--no-loadscope-reorder``, xdist hands out files in this order, the next to the worker that finishes
    first); and a test of the server outside ``SERVER_FILES`` would make a second worker start its own."""
    items.sort(key=lambda item: not item.nodeid.startswith(ENGINE_TESTS))
    strays = [
        item.nodeid
        for item in items
        if "server" in item.fixturenames and item.nodeid.split("::")[0] not in SERVER_FILES
    ]
    if strays:
        raise pytest.UsageError(f"tests of the shared server outside SERVER_FILES (tests/conftest.py): {strays}")


@pytest.fixture(scope="session")
def model_path() -> Path:
    from kvpolicy.offline.model import prepare

    return prepare()


@pytest.fixture(scope="session")
def forked():
    """Engine runs and ``vllm`` commands in processes forked from one that has imported vLLM
    (``tests/e2e/forked_runs.py``); its server starts at the first."""
    from tests.e2e.forked_runs import ForkedRuns

    return ForkedRuns()
