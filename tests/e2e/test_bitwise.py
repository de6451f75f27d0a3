"""``--kv-policy none`` and ``identity`` are bitwise identical to stock vLLM (split-KV off).

Each engine runs in its own process (``engine_run.py``) on the same mixed
batch: six prompts of 40 to 1100 tokens, chunked prefill at 256 tokens per
step, so relocated requests decode beside stock prefills in one step.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("engine_run.py")


@pytest.fixture(scope="module")
def runs(model_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bitwise")
    results = {}
    for name, flags in {"stock": ["--stock"], "none": ["--policy", "none"], "identity": ["--policy", "identity"]}.items():
        out = out_dir / f"{name}.json"
        proc = subprocess.run(
            [sys.executable, str(RUNNER), "--model", str(model_path), "--out", str(out), *flags],
            capture_output=True, text=True, timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[name] = json.loads(out.read_text())
    return results


@pytest.mark.parametrize("policy", ["none", "identity"])
def test_tokens_and_logprobs_are_bitwise_identical_to_stock(runs, policy):
    stock, ours = runs["stock"]["requests"], runs[policy]["requests"]
    assert len(ours) == len(stock) == 6
    for i, (a, b) in enumerate(zip(stock, ours)):
        assert a["token_ids"] == b["token_ids"], f"request {i}: tokens differ"
        assert a["logprobs"] == b["logprobs"], f"request {i}: logprobs differ"


def test_identity_really_took_the_per_head_path(runs):
    assert runs["identity"]["relocated_requests"] == 6
    assert runs["none"]["relocated_requests"] == 0
