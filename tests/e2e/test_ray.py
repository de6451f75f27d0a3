"""vLLM's Ray executor (``--distributed-executor-backend ray``) on this CPU build: refused by vLLM, kvpolicy or not.

A one-node Ray cluster (``ray start --head --node-ip-address 127.0.0.1``,
Ray from the ``kvpolicy[ray]`` extra; Ray 2.60 still serves it on the
machine's own address) is started and killed here, and ``vllm serve`` joins
it through ``RAY_ADDRESS``. vLLM 0.32's CPU platform names no Ray
device (``CpuPlatform.ray_device_key`` is empty), so the engine stops in
``initialize_ray_cluster`` once connected, before any Ray worker exists:
``ValueError: current platform cpu does not support ray.``, with kvpolicy's
options as without them, for tensor and pipeline parallelism alike. kvpolicy
under Ray workers (plugins loaded in each actor, the connector's worker half
there, metrics from other processes) needs a platform with a Ray device, a
GPU; nothing here has run it. When vLLM's CPU platform accepts Ray, this test
fails and the comparison with the multiprocessing executor belongs here.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.server import free_port
from kvpolicy.offline.model import prepare_tiny

pytestmark = pytest.mark.engine

KV_OPTIONS = ("--kv-policy", "adasnap", "--kv-budget", "64")
REFUSAL = "ValueError: current platform cpu does not support ray."
RAY_START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """The address of a Ray head on 127.0.0.1, in a session of its own, killed (the whole session) after: its workers
    end with its raylet."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    log_path = tmp_path_factory.mktemp("ray") / "ray-start.log"
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1"]
    cmd += ["--port", str(port), "--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats"]
    cmd += ["--temp-dir", temp, "--object-store-memory", str(100 << 20)]
    with open(log_path, "w") as log:
        head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while "Ray runtime started" not in log_path.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # ``ray start --block`` took over 30 s to end on SIGTERM
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize(
    "options, split",
    [
        (KV_OPTIONS, ("--tensor-parallel-size", "2")),
        (KV_OPTIONS, ("--pipeline-parallel-size", "2")),
        ((), ("--tensor-parallel-size", "2")),
    ],
    ids=["adasnap-tp2", "adasnap-pp2", "stock-tp2"],
)
def test_vllms_cpu_platform_refuses_the_ray_executor_with_or_without_kvpolicy(
    forked, ray_head, tmp_path, options, split
):
    model = prepare_tiny(num_layers=4, num_heads=8, num_kv_heads=4, head_size=64)
    argv = ["serve", str(model), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", *options]
    argv += ["--distributed-executor-backend", "ray", *split]
    env = dict(os.environ, RAY_ADDRESS=ray_head, VLLM_CPU_KVCACHE_SPACE="1")
    code, stdout, stderr = forked.vllm(argv, tmp_path / "serve", timeout=600, env=env)
    output = stdout + stderr
    assert code != 0
    assert "Connecting to existing Ray cluster at address" in output
    assert REFUSAL in output
    assert "Loading weights" not in output
