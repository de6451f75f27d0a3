"""The Grafana dashboard against a real Prometheus scraping the real server: every panel's query has data."""

import math
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.prometheus import SCRAPE_INTERVAL_S, Prometheus, panel_queries
from tests.e2e.conftest import SERVED_NAME, SERVED_POLICY
from tests.e2e.test_server import FRANCE, LONG_PROMPT


def workload(client) -> None:
    """Compressed long prompts (one streamed) beside short stock-sized chats, a few at a time."""

    def long_prompt(stream: bool) -> None:
        # Two different prompts: identical ones at once would share their blocks through the prefix cache,
        # leaving neither room of its own to compress into.
        reply = client.completions.create(
            model=SERVED_NAME,
            prompt=f"Stream {stream}. {LONG_PROMPT}",
            max_tokens=48,
            temperature=0,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            for _ in reply:
                pass

    def chat() -> None:
        client.chat.completions.create(model=SERVED_NAME, messages=FRANCE, max_tokens=8, temperature=0)

    with ThreadPoolExecutor(4) as pool:
        for job in (
            pool.submit(long_prompt, True),
            pool.submit(long_prompt, False),
            pool.submit(chat),
            pool.submit(chat),
        ):
            job.result()


def test_every_dashboard_panel_has_data_in_a_real_prometheus(server, client):
    with Prometheus(target=server.removeprefix("http://")) as prometheus:
        prometheus.wait_for_scrape()
        workload(client)
        time.sleep(3 * SCRAPE_INTERVAL_S)
        empty = []
        for query in panel_queries():
            values = [float(sample["value"][1]) for sample in prometheus.query(query.expr)]
            if not any(math.isfinite(value) for value in values):
                empty.append(f"{query.panel} [{query.ref_id}]: {query.expr} -> {values}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
        saved = prometheus.query(f'max_over_time(vllm:kvpolicy_saved_kv_bytes{{policy="{SERVED_POLICY}"}}[1m])')
        assert float(saved[0]["value"][1]) > 0, "the saved-bytes gauge never showed the running requests' saving"
