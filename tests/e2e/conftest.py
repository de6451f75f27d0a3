"""One real ``vllm serve`` for the whole session, talked to over HTTP on loopback."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import pytest

from benchmarks.server import vllm_server
from kvpolicy.offline.model import prepare_tiny
from tests.conftest import XDIST_WORKER_ENV

SERVED_NAME = "smollm2"
SERVED_POLICY, SERVED_BUDGET = "adasnap", 256


@pytest.fixture(scope="session")
def server(model_path: Path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    args = [
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--kv-policy",
        SERVED_POLICY,
        "--kv-budget",
        str(SERVED_BUDGET),
    ]
    with vllm_server(model_path, args, log_path) as base:
        yield base


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def engine_run(model_path, tmp_path_factory, forked):
    """``engine_run(*flags)``: one offline engine run of ``engine_run.py``, memoized per flags, in a process forked
    from one that has imported vLLM (``forked_runs.py``). The memo is on disk, shared by the test workers of one
    session (pytest-xdist's workers share the base temporary folder's parent): a run another worker made or is
    making is read, not made again.

    With ``fails=True`` the engine must not start; the result is its stderr.
    ``model``: another model folder than the default one.
    """
    base = tmp_path_factory.getbasetemp()
    out_dir = (base.parent if os.environ.get(XDIST_WORKER_ENV) else base) / "engine-runs"
    out_dir.mkdir(exist_ok=True)

    def run(*flags: str, fails: bool = False, model=None) -> dict | str:
        model = str(model or model_path)
        key = hashlib.sha256(json.dumps([model, *flags]).encode()).hexdigest()[:20]
        out, stderr_file = out_dir / f"{key}.json", out_dir / f"{key}.refused"
        with open(out_dir / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker making this run: wait for it
            if not (out.exists() or stderr_file.exists()):
                argv = ["--model", model, "--out", str(out), *flags]
                code, stderr = forked.engine_run(argv, out_dir / key, timeout=900)
                if fails:
                    assert code != 0, "the engine was expected to refuse these settings"
                    stderr_file.write_text(stderr)
                else:
                    assert code == 0, stderr[-4000:]
        return stderr_file.read_text() if fails else json.loads(out.read_text())

    return run


#: ``--pool-mib`` for ``mib_block_model``: 17 blocks, one of which vLLM keeps back, so 16 (2,048 tokens) for the
#: default prompts' 23: the real model's 96 MiB, block for block.
POOL_16_BLOCKS = ("--pool-mib", "17")


@pytest.fixture(scope="session")
def mib_block_model() -> Path:
    """A random-weight Llama whose 128-token block is 1 MiB (8 layers, 4 KV heads of 32 and GQA groups of two, in
    float32), for the tests of a pool too small for the prompts (preemption, offload, a prompt three times the
    pool): the scheduler sees blocks, not the model, so ``--pool-mib N`` plays out as N of the real model's 5.6-MiB
    blocks, at a twentieth of its compute (runs of 40-83 s took 6-21 s in the suite)."""
    return prepare_tiny(num_layers=8, num_heads=8, num_kv_heads=4, head_size=32)


def shared_prefix_args(policy: str, *flags: str) -> tuple[str, ...]:
    """``engine_run`` flags for prompts after a shared 2,000-token prefix (the first alone, then the rest at once)."""
    from kvpolicy.policies import POLICIES

    budget = ("--budget", "256") if POLICIES[policy].needs_budget else ()
    return ("--policy", policy, *budget, "--max-model-len", "4096", "--shared-prefix", "2000", *flags)


def assert_same_outputs(off: dict, on: dict, atol: float = 1e-3) -> None:
    """Two ``engine_run`` results give the same tokens, and logprobs within ``atol``."""
    for cold, warm in zip(off["requests"], on["requests"], strict=True):
        assert warm["token_ids"] == cold["token_ids"]
        for cold_step, warm_step in zip(cold["logprobs"], warm["logprobs"]):
            assert warm_step.keys() == cold_step.keys()
            assert all(abs(warm_step[t] - cold_step[t]) <= atol for t in cold_step)
