"""A real Prometheus on loopback scraping a vLLM server, and the Grafana dashboard's queries run through it.

The dashboard test and ``benchmarks/load.py --dashboard`` share this: the
panels' PromQL is read from the committed dashboard JSON, Grafana's
variables are given fixed values, and Prometheus's HTTP API answers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from benchmarks.server import free_port

DASHBOARD = Path(__file__).resolve().parents[1] / "docker" / "grafana" / "dashboards" / "kvpolicy.json"
#: Grafana's interval variables, fixed: a scrape every second makes a 15 s window hold enough samples.
SCRAPE_INTERVAL_S = 1
GRAFANA_VARIABLES = {"$__rate_interval": "15s", "$__interval": "1s", "$__range": "5m"}
INSTALL_HINT = (
    "Prometheus is not installed: `make prometheus` installs Debian's package (apt-get, as root or with sudo)"
)


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref_id: str
    legend: str
    expr: str


def panel_queries(dashboard: Path = DASHBOARD) -> list[PanelQuery]:
    """Every query of every panel, with Grafana's variables replaced by PromQL durations."""
    queries = []
    for panel in json.loads(dashboard.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append(PanelQuery(panel["title"], target["refId"], target.get("legendFormat", ""), expr))
    return queries


class Prometheus:
    """``with Prometheus(target="127.0.0.1:8000") as prom: prom.query(expr)``: a throwaway server, data in a temp dir."""

    def __init__(self, target: str, binary: str = "prometheus"):
        self.target = target
        self.binary = shutil.which(binary)
        if self.binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.url = f"http://127.0.0.1:{free_port()}"

    def __enter__(self) -> Prometheus:
        self._dir = tempfile.TemporaryDirectory(prefix="kvpolicy-prometheus-")
        root = Path(self._dir.name)
        (root / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
            f"scrape_configs:\n  - job_name: vllm\n    static_configs:\n      - targets: ['{self.target}']\n"
        )
        self._log = open(root / "prometheus.log", "w")
        self._proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not self._ready():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"Prometheus did not start:\n{(root / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        return self

    def _ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()
        self._dir.cleanup()

    def _api(self, path: str, **params) -> list[dict]:
        answer = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        if answer["status"] != "success":
            raise RuntimeError(f"Prometheus refused {params.get('query')!r}: {answer.get('error')}")
        return answer["data"]["result"]

    def query(self, expr: str) -> list[dict]:
        """An instant query: ``[{"metric": {...}, "value": [time, "text"]}, ...]``."""
        return self._api("query", query=expr)

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        """A range query: ``[{"metric": {...}, "values": [[time, "text"], ...]}, ...]``."""
        return self._api("query_range", query=expr, start=start, end=end, step=step_s)

    def wait_for_scrape(self, timeout_s: float = 30) -> None:
        """Until Prometheus has scraped the target once (``up == 1``)."""
        deadline = time.monotonic() + timeout_s
        while not any(sample["value"][1] == "1" for sample in self.query("up")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus could not scrape {self.target}")
            time.sleep(0.5)
