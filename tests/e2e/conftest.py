"""One real ``vllm serve`` for the whole session, talked to over HTTP on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import json

import pytest
import requests

SERVED_NAME = "smollm2"
SERVED_POLICY, SERVED_BUDGET = "adasnap", 256
STARTUP_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(model_path: Path, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        str(Path(sys.executable).parent / "vllm"), "serve", str(model_path),
        "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", "4096",
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-policy", SERVED_POLICY, "--kv-budget", str(SERVED_BUDGET),
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


ENGINE_RUNNER = Path(__file__).with_name("engine_run.py")


@pytest.fixture(scope="session")
def engine_run(model_path, tmp_path_factory):
    """``engine_run(*flags)``: one offline engine run of ``engine_run.py``, memoized per flags.

    With ``fails=True`` the engine must not start; the result is its stderr.
    ``model``: another model folder than the default one.
    """
    out_dir = tmp_path_factory.mktemp("engine-runs")
    done: dict[tuple, dict | str] = {}

    def run(*flags: str, fails: bool = False, model=None) -> dict | str:
        model = str(model or model_path)
        key = (model, *flags)
        if key not in done:
            out = out_dir / f"run{len(done)}.json"
            proc = subprocess.run(
                [sys.executable, str(ENGINE_RUNNER), "--model", model, "--out", str(out), *flags],
                capture_output=True, text=True, timeout=900,
            )
            if fails:
                assert proc.returncode != 0, "the engine was expected to refuse these settings"
                done[key] = proc.stderr
            else:
                assert proc.returncode == 0, proc.stderr[-4000:]
                done[key] = json.loads(out.read_text())
        return done[key]

    return run
