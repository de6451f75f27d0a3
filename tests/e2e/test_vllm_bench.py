"""The benchmark commands operators already use, with kvpolicy on: ``vllm bench throughput`` with ``--kv-*``
flags, and ``vllm bench serve`` against the served model with per-request options in ``vllm_xargs``.

Tiny runs (a few prompts, a few output tokens), not a measure of speed. Both
commands load vLLM's plugins before parsing, so an option kvpolicy did not
add would stop them; through the server, the requests ``vllm bench serve``
sends are each compressed to the budget they carry.
"""

import json
import os
from pathlib import Path

import pytest

from tests.e2e.conftest import SERVED_NAME
from tests.e2e.test_server import LAYERS_X_KV_HEADS, kvpolicy_metrics

BUDGET = 128  # tokens per KV head: the prompts below are several times longer


def vllm_bench(forked, log_stem: Path, *args: str) -> str:
    """``vllm bench *args`` forked from a process that has imported vLLM (tests/conftest.py): its stdout."""
    # The throughput run's engine in its own process: on CPU vLLM would spawn its engine core, a second vLLM import.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    code, stdout, stderr = forked.vllm(["bench", *args], log_stem, timeout=600, env=env)
    assert code == 0, stderr[-3000:]
    return stdout


@pytest.mark.engine
def test_vllm_bench_throughput_runs_with_the_kv_flags(forked, model_path, tmp_path):
    result = tmp_path / "throughput.json"
    stdout = vllm_bench(
        forked,
        tmp_path / "throughput",
        "throughput",
        "--model", str(model_path),
        "--dtype", "float32",
        "--max-model-len", "2048",
        "--enforce-eager",
        "--kv-policy", "adasnap",
        "--kv-budget", str(BUDGET),
        "--dataset-name", "random",
        "--random-input-len", "700",
        "--random-output-len", "8",
        "--num-prompts", "4",
        "--output-json", str(result),
    )  # fmt: skip
    assert "Throughput:" in stdout
    report = json.loads(result.read_text())
    assert report["num_requests"] == 4 and report["tokens_per_second"] > 0


@pytest.mark.engine
def test_vllm_bench_serve_sends_per_request_options(forked, server, model_path, tmp_path):
    before = kvpolicy_metrics(server)
    vllm_bench(
        forked,
        tmp_path / "serve",
        "serve",
        "--backend", "openai",
        "--base-url", server,
        "--model", SERVED_NAME,
        "--tokenizer", str(model_path),
        "--dataset-name", "random",
        "--random-input-len", "700",
        "--random-output-len", "8",
        "--num-prompts", "4",
        "--extra-body", json.dumps({"vllm_xargs": {"kv_budget": BUDGET}}),
        "--save-result",
        "--result-dir", str(tmp_path),
        "--result-filename", "serve.json",
    )  # fmt: skip
    report = json.loads((tmp_path / "serve.json").read_text())
    assert report["completed"] == 4 and report["failed"] == 0
    after = kvpolicy_metrics(server)
    assert after["compressed_requests"] - before.get("compressed_requests", 0) == 4
    kept = after["kept_kv_tokens"] - before.get("kept_kv_tokens", 0)
    assert kept == pytest.approx(4 * BUDGET * LAYERS_X_KV_HEADS, rel=0.02), "each request kept its own budget"
