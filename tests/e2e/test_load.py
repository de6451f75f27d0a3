"""The load benchmark's quick preset against the real server: nothing lost, every bad input a 400, the pool empty after."""

from transformers import AutoTokenizer

from benchmarks.load import PRESETS, run


def test_quick_load_has_no_server_errors_and_returns_every_block(server, model_path):
    summary, results = run(server, PRESETS["quick"], AutoTokenizer.from_pretrained(str(model_path)))
    assert summary["failures"] == []
    assert summary["5xx"] == summary["4xx"] == summary["error"] == 0
    assert summary["rejected"] == sum(r["kind"] == "bad" for r in results) > 0
    assert summary["aborted"] > 0 and summary["ok"] > 0
    assert summary["pool_empty"] and summary["still_serving"]
