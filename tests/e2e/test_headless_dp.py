"""Data parallelism over two hosts: a head and a ``--headless`` engine, each with the same ``--kv-*`` options.

The head (``vllm serve --data-parallel-size 2 --data-parallel-size-local 1
--data-parallel-address 127.0.0.1 --data-parallel-rpc-port P``) runs the API
server, vLLM's coordinator and rank 0; the other host (``--headless
--data-parallel-start-rank 1``, ``VLLM_HOST_IP=127.0.0.2``) runs rank 1 alone.
They share no process tree: with a remote rank the head talks to its engines
over TCP on the data-parallel address, and the headless engine connects to
it. Each engine's scheduler and workers run kvpolicy; the head's API server
exports both engines' metrics. The small random-weight Llama of the
tensor-parallel test keeps the two starts short.

A rank lost: vLLM 0.32's head learns nothing when a headless engine dies (a
dense model's ranks never talk to each other, and the head watches only its
own processes), so a request on the lost rank waits for tokens that never
come, ``/health`` stays 200 and the lost engine's series keep their last
values. Stock vLLM does the same (docs/operations.md, "More than one
machine"). The surviving rank serves on with nothing held.
"""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from benchmarks.server import free_port, scrape, vllm_server
from kvpolicy.offline.model import prepare_tiny
from tests.e2e.test_server import LONG_PROMPT

pytestmark = pytest.mark.engine

SERVED = "tiny-dp"
KV_OPTIONS = ("--kv-policy", "adasnap", "--kv-budget", "64")
#: Seconds without a token that show a request on the lost rank is left waiting (a healthy one streams a token
#: every fraction of a second).
SILENCE_S = 20


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """The head's base URL and the headless engine's process (its own session: killing it loses the host)."""
    model = prepare_tiny(num_layers=4, num_heads=8, num_kv_heads=4, head_size=64)
    logs = tmp_path_factory.mktemp("headless-dp")
    args = ["--served-model-name", SERVED, "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"]
    args += [*KV_OPTIONS, "--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    args += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port())]
    head_args = [*args, "--api-server-count", "1"]  # vLLM starts one per rank by default: a process fewer
    vllm = str(Path(sys.executable).parent / "vllm")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.2")
    with open(logs / "headless.log", "w") as log:
        headless = subprocess.Popen(
            [vllm, "serve", str(model), "--headless", "--data-parallel-start-rank", "1", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        with vllm_server(model, head_args, logs / "head.log", env={"VLLM_HOST_IP": "127.0.0.1"}) as base:
            yield base, headless
    finally:
        if headless.poll() is None:
            os.killpg(headless.pid, signal.SIGTERM)
            try:
                headless.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(headless.pid, signal.SIGKILL)


def completion(base: str, prompt: str, rank: int | None = None, **body) -> requests.Response:
    """A greedy completion; ``rank``: the engine it goes to (vLLM's ``X-data-parallel-rank`` header), else the
    head's load balancer chooses. A streamed one fails after ``SILENCE_S`` without a token."""
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    stream = body.get("stream", False)
    timeout = (10, SILENCE_S if stream else 300)
    return requests.post(f"{base}/v1/completions", json=body, headers=headers, timeout=timeout, stream=stream)


def by_engine(samples: dict[str, float], metric: str) -> dict[str, float]:
    """A metric's value per ``engine`` label, summed over its other labels."""
    values: dict[str, float] = {}
    for name, value in samples.items():
        if name.split("{", 1)[0] == metric:
            engine = re.search(r'engine="(\d+)"', name).group(1)
            values[engine] = values.get(engine, 0) + value
    return values


def scrape_until(base: str, done, timeout_s: float = 30) -> dict[str, float]:
    """``/metrics`` once ``done(samples)`` holds, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not done(samples := scrape(base)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return samples


def test_both_hosts_compress_their_requests_and_the_head_reports_both(two_hosts):
    base, _ = two_hosts
    before = scrape(base)
    assert by_engine(before, "vllm:kv_cache_usage_perc") == {"0": 0, "1": 0}
    same = [completion(base, LONG_PROMPT, rank, logprobs=2).json()["choices"][0]["logprobs"] for rank in (0, 1)]
    assert same[1]["tokens"] == same[0]["tokens"]
    assert all(abs(a - b) < 1e-4 for a, b in zip(same[0]["token_logprobs"], same[1]["token_logprobs"], strict=True))
    with ThreadPoolExecutor(6) as pool:  # at once: the head's balancer spreads them
        replies = list(pool.map(lambda i: completion(base, f"{i}. {LONG_PROMPT}"), range(6)))
    assert all(reply.status_code == 200 for reply in replies)
    after = scrape_until(base, lambda s: not any(by_engine(s, "vllm:kv_cache_usage_perc").values()))
    assert by_engine(after, "vllm:kv_cache_usage_perc") == {"0": 0, "1": 0}

    def grew(metric: str) -> dict[str, float]:
        old = by_engine(before, metric)
        return {engine: value - old.get(engine, 0) for engine, value in by_engine(after, metric).items()}

    finished, compressed = grew("vllm:request_success_total"), grew("vllm:kvpolicy_compressed_requests_total")
    assert sum(finished.values()) == 8 and all(count > 1 for count in finished.values()), finished  # 1 directed each
    assert compressed == finished  # every prompt is over the budget, each counted once, by its own engine
    assert all(count > 0 for count in grew("vllm:kvpolicy_released_blocks_total").values())
    # Not the gauge of compressed requests: an idle engine's last snapshot is its last step's, taken before its
    # requests finished (a clean clone's run read {"0": 0, "1": 2} with both pools empty); the pools are above.


def test_a_lost_host_leaves_its_requests_waiting_and_the_other_rank_serving(two_hosts):
    base, headless = two_hosts
    streams = {rank: completion(base, f"{rank}. {LONG_PROMPT}", rank, max_tokens=256, stream=True) for rank in (0, 1)}
    chunks = {rank: reply.iter_lines() for rank, reply in streams.items()}
    for rank in (0, 1):  # both ranks are generating
        assert next(line for line in chunks[rank] if line).startswith(b"data: {")
    os.killpg(headless.pid, signal.SIGKILL)
    headless.wait()
    assert b"data: [DONE]" in list(chunks[0])  # rank 0's request ends as usual
    with pytest.raises(requests.ConnectionError, match="Read timed out"):
        for line in chunks[1]:
            assert line != b"data: [DONE]"
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    assert completion(base, LONG_PROMPT, rank=0).status_code == 200
    # Both gauges of rank 0's last step: they can reach /metrics a scrape apart.
    gauges = ("vllm:kv_cache_usage_perc", "vllm:kvpolicy_num_requests_compressed")
    samples = scrape_until(base, lambda s: all(by_engine(s, gauge)["0"] == 0 for gauge in gauges))
    assert by_engine(samples, "vllm:kv_cache_usage_perc")["0"] == 0
    assert by_engine(samples, "vllm:kvpolicy_num_requests_compressed")["0"] == 0
    assert by_engine(samples, "vllm:num_requests_running")["1"] >= 1  # the lost engine's last report, kept
