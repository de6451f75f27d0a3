"""Data parallelism through vLLM: two engines behind one ``vllm serve``, each compressing its own requests.

``--data-parallel-size 2`` starts two engine cores and, by default, two API
servers that share a Prometheus registry; each engine's series carry its
``engine`` label. Requests sent at once spread over both engines, and each
engine compresses. Every dashboard panel's query, run in a real Prometheus
scraping that server, sums or takes the max over engines: no result keeps an
``engine`` label, and the compressed-requests panel equals the engines'
counts added up.
"""

import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.prometheus import SCRAPE_INTERVAL_S, Prometheus, panel_queries
from benchmarks.server import vllm_server
from tests.e2e.test_server import LONG_PROMPT

pytestmark = pytest.mark.engine

SERVED = "smollm2-dp"
COMPRESSED = "vllm:kvpolicy_compressed_requests_total"


@pytest.fixture(scope="module")
def dp_server(model_path, tmp_path_factory):
    args = ["--served-model-name", SERVED, "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"]
    args += ["--kv-policy", "adasnap", "--kv-budget", "64", "--data-parallel-size", "2"]
    # Two engine cores: vLLM binds them itself (a test worker's one core, tests/conftest.py, would not split).
    log = tmp_path_factory.mktemp("dp") / "vllm-serve.log"
    with vllm_server(model_path, args, log, env={"VLLM_CPU_OMP_THREADS_BIND": "auto"}) as base:
        yield base


def send_at_once(base: str, count: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)

    def one(i: int) -> None:
        client.completions.create(model=SERVED, prompt=f"{i}. {LONG_PROMPT}", max_tokens=4, temperature=0)

    with ThreadPoolExecutor(count) as pool:
        list(pool.map(one, range(count)))


def test_both_engines_compress_and_every_panel_aggregates_over_them(dp_server):
    with Prometheus(target=dp_server.removeprefix("http://")) as prometheus:
        prometheus.wait_for_scrape()
        send_at_once(dp_server, 4)
        time.sleep(3 * SCRAPE_INTERVAL_S)
        per_engine = {s["metric"]["engine"]: float(s["value"][1]) for s in prometheus.query(COMPRESSED)}
        assert set(per_engine) == {"0", "1"} and all(count > 0 for count in per_engine.values()), per_engine
        for query in panel_queries():
            samples = prometheus.query(query.expr)
            assert all("engine" not in s["metric"] for s in samples), f"{query.panel}: {query.expr}"
            assert any(math.isfinite(float(s["value"][1])) for s in samples), f"{query.panel}: {query.expr}"
        (panel,) = [q for q in panel_queries() if q.expr == f"sum({COMPRESSED})"]
        (total,) = prometheus.query(panel.expr)
        assert float(total["value"][1]) == sum(per_engine.values())
