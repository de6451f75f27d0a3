"""benchmarks/decode.py's bound: the full cache's step over a step whose sparse layers cost nothing."""

import pytest

from benchmarks.decode import SHORT_CONTEXT, add_bounds


def row(policy: str, context: int, ms: float, batch: int = 4) -> dict:
    return {"policy": policy, "context": context, "batch": batch, "ms_per_token": ms}


def test_the_bound_keeps_the_full_attention_layers_share_of_attention():
    rows = [row("full cache", SHORT_CONTEXT, 20.0), row("full cache", 7600, 80.0), row("omnikv", 7600, 50.0)]
    add_bounds(rows, layers=30, full_attention_layers=8)
    short, full, omnikv = rows
    # 2 ms of attention per layer at 7,600 tokens: 20 + 8 x 2 = 36 ms with free sparse layers.
    assert omnikv["speedup"] == pytest.approx(1.6) and omnikv["bound"] == pytest.approx(80 / 36)
    assert omnikv["of_bound"] == pytest.approx(1.6 * 36 / 80)
    assert full["speedup"] == 1.0 and full["bound"] is None and short["bound"] is None


def test_no_bound_without_the_short_context_run_of_the_same_batch():
    rows = [row("full cache", SHORT_CONTEXT, 20.0, batch=1), row("full cache", 7600, 80.0), row("omnikv", 7600, 50.0)]
    add_bounds(rows, layers=30, full_attention_layers=8)
    assert rows[2]["speedup"] == pytest.approx(1.6) and rows[2]["bound"] is None and rows[2]["of_bound"] is None
