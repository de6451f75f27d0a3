"""A compressing policy in the real engine: blocks really go back to vLLM, untouched requests stay exact."""

from tests.e2e.engine_run import PROMPT_LENS

BUDGET = 128


def test_adasnap_releases_blocks_and_returns_them_all(engine_run):
    run = engine_run("--policy", "adasnap", "--budget", str(BUDGET))
    counters = run["counters"]
    compressible = sum(n > BUDGET for n in PROMPT_LENS)
    assert counters["relocated_requests"] == counters["compressed_requests"] == compressible
    assert counters["released_blocks"] > 0
    assert counters["released_bytes"] > 0
    # Every relocated request keeps ~BUDGET tokens per (layer, head) of its prompt.
    layers_heads = counters["prompt_kv_tokens"] / sum(n for n in PROMPT_LENS if n > BUDGET)
    assert abs(counters["kept_kv_tokens"] / layers_heads - compressible * BUDGET) <= compressible
    assert run["kv_cache_usage_end"] == 0.0, "every block is free again after the run"


def test_requests_below_the_budget_stay_bitwise_identical(engine_run):
    stock = engine_run("--stock")["requests"]
    ours = engine_run("--policy", "adasnap", "--budget", str(BUDGET))["requests"]
    for i, n in enumerate(PROMPT_LENS):
        if n <= BUDGET:
            assert ours[i] == stock[i], f"request {i} ({n} tokens) was not compressed and must be exact"

