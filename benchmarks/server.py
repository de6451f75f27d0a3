"""A real ``vllm serve`` on loopback for the tests and the load benchmark: started, waited for, stopped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(
    model: Path, args: list[str], log_path: Path, kv_cache_gib: int = 1, env: dict[str, str] | None = None
) -> Iterator[str]:
    """``vllm serve model *args`` on a free loopback port (``env``: variables set for it); yields its base URL
    once ``/health`` answers. The KV pool is ``kv_cache_gib``, unless ``args`` size it with
    ``--kv-cache-memory-bytes`` (vLLM's CPU worker takes ``VLLM_CPU_KVCACHE_SPACE`` over that flag)."""
    port = free_port()
    env = dict(os.environ, **(env or {}))
    if "--kv-cache-memory-bytes" in args:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    cmd = [
        str(Path(sys.executable).parent / "vllm"),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
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


def scrape(base: str) -> dict[str, float]:
    """``/metrics`` as ``{name{labels}: value}`` for every sample line."""
    samples = {}
    for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
