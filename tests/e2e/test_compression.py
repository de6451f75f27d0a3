"""A compressing policy in the real engine: blocks really go back to vLLM, untouched requests stay exact,
preemption redoes compression, and the policy's choices on real tensors equal the plain reference."""

import pytest
import torch

from kvpolicy.policies import PromptKV, make_policy
from tests.e2e.conftest import POOL_16_BLOCKS
from tests.e2e.engine_run import PROMPT_LENS
from tests.snapkv_reference import reference_ada_counts, reference_keep, reference_pyramid, reference_scores

BUDGET = 128
ADASNAP = ("--policy", "adasnap", "--budget", str(BUDGET), "--capture")
WINDOW, KERNEL = 32, 7


def test_adasnap_releases_blocks_and_returns_them_all(engine_run):
    run = engine_run(*ADASNAP)
    counters = run["counters"]
    compressible = sum(n > BUDGET for n in PROMPT_LENS)
    assert counters["relocated_requests"] == counters["compressed_requests"] == compressible
    assert counters["released_blocks"] > 0
    assert counters["released_bytes"] == counters["released_blocks"] * run["block_bytes"]
    # Every relocated request keeps ~BUDGET tokens per (layer, head) of its prompt.
    layers_heads = counters["prompt_kv_tokens"] / sum(n for n in PROMPT_LENS if n > BUDGET)
    assert abs(counters["kept_kv_tokens"] / layers_heads - compressible * BUDGET) <= compressible
    assert run["kv_cache_usage_end"] == 0.0, "every block is free again after the run"


def test_requests_below_the_budget_stay_bitwise_identical(engine_run):
    stock = engine_run("--stock")["requests"]
    ours = engine_run(*ADASNAP)["requests"]
    for i, n in enumerate(PROMPT_LENS):
        if n <= BUDGET:
            assert ours[i] == stock[i], f"request {i} ({n} tokens) was not compressed and must be exact"


@pytest.mark.parametrize(
    "policy", ["snapkv", "pyramid", "adapyramid", "adamix", "adaheavy", "streaming", "keydiff", "h2o", "d2o"]
)
def test_every_compressing_policy_runs_in_the_engine(engine_run, policy):
    run = engine_run("--policy", policy, "--budget", str(BUDGET))
    counters = run["counters"]
    compressible = [n for n in PROMPT_LENS if n > BUDGET]
    assert counters["compressed_requests"] == len(compressible)
    layers_heads = counters["prompt_kv_tokens"] / sum(compressible)
    mean_kept = counters["kept_kv_tokens"] / layers_heads / len(compressible)
    assert abs(mean_kept - BUDGET) <= 0.05 * BUDGET, "a head keeps the budget on average over layers"
    assert run["kv_cache_usage_end"] == 0.0
    stock = engine_run("--stock")["requests"]
    for i, n in enumerate(PROMPT_LENS):
        if n <= BUDGET:
            assert run["requests"][i] == stock[i], f"request {i} ({n} tokens) was not compressed and must be exact"


@pytest.mark.parametrize("policy", ["h2o", "d2o"])
def test_attention_policies_evict_in_decode_a_page_at_a_time(engine_run, policy):
    """A page's worth of output past the budget (block size 128) is one eviction pass per compressed request.

    Adding each new token's attention to the scores changes nothing before
    that pass: the first tokens equal the short run's. Every block comes back.
    """
    run = engine_run("--policy", policy, "--budget", str(BUDGET), "--max-tokens", "136")
    short = engine_run("--policy", policy, "--budget", str(BUDGET))
    assert run["counters"]["eviction_passes"] == sum(n > BUDGET for n in PROMPT_LENS)
    assert run["counters"]["released_blocks"] > short["counters"]["released_blocks"]
    assert run["kv_cache_usage_end"] == 0.0
    for long_request, short_request in zip(run["requests"], short["requests"]):
        assert long_request["token_ids"][: len(short_request["token_ids"])] == short_request["token_ids"]


@pytest.mark.parametrize("policy, decode", [("pyramid", ()), ("d2o", ("--max-tokens", "136"))])
def test_one_page_pool_for_every_layer_moves_pages_not_what_attention_reads(engine_run, policy, decode):
    """Layer-varying budgets with one page pool over every layer (the CPU default) against a pool per
    layer: the same tokens and logprobs bit for bit, no more pages held, more blocks handed back, every
    block free after; ``d2o``'s run also packs after its eviction passes in decode (right after
    compression, at budget 128 and 128-token blocks, both hold the same pages on these prompts)."""
    pooled = engine_run("--policy", policy, "--budget", str(BUDGET), *decode)  # the runs of the tests above
    per_layer = engine_run("--policy", policy, "--budget", str(BUDGET), *decode, "--page-pool", "layer")
    assert pooled["requests"] == per_layer["requests"]
    assert pooled["counters"]["held_kv_pages"] <= per_layer["counters"]["held_kv_pages"]
    assert pooled["counters"]["released_blocks"] > per_layer["counters"]["released_blocks"]
    assert pooled["kv_cache_usage_end"] == per_layer["kv_cache_usage_end"] == 0.0


@pytest.mark.parametrize("policy, chunks", [("h2o", ()), ("adaheavy", ("--chunk", "548"))])
def test_prompt_scores_add_up_over_chunks(engine_run, policy, chunks):
    """H2O's prompt scores come from kvpolicy's own prompt attention (one QK^T for the output and
    the column sums), chunk by chunk: a 1,100-token prompt read in 256-token chunks gets the sums,
    and keeps the tokens, it gets when read in one chunk. Each query's weights sum to one. Ada-Heavy,
    read in chunks of 548 tokens (its 16-token window across the last two), also gets the window's
    queries from the summed chunks they fall in, the same (to 1e-4: its 548-row chunks project queries in
    other matrix shapes than 256 or 1,100 rows, which round differently in float32)."""
    flags = ("--policy", policy, "--budget", str(BUDGET), "--prompt-lens", "1100", "--capture")
    chunked = torch.load(engine_run(*flags, *chunks)["captured"])
    whole = torch.load(engine_run(*flags, "--chunk", "2048")["captured"])
    for layer in (0, 15, 29):
        sums = chunked[layer]["column_sums"]
        torch.testing.assert_close(sums, whole[layer]["column_sums"], rtol=1e-5, atol=1e-6 if not chunks else 1e-4)
        torch.testing.assert_close(sums.sum(dim=1), torch.full((sums.shape[0],), 1100.0, dtype=torch.float64))
        assert [k.tolist() for k in chunked[layer]["kept"]] == [k.tolist() for k in whole[layer]["kept"]]
        if policy == "adaheavy":
            window = chunked[layer]["window_queries"]
            assert window.shape[1] == 16
            torch.testing.assert_close(window, whole[layer]["window_queries"], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def captured(engine_run):
    """What adasnap saw and kept in the engine, for the 1,100-token prompt at layers 0, 15 and 29."""
    run = engine_run(*ADASNAP)
    records = torch.load(run["captured"])
    assert sorted(records) == [0, 15, 29]
    return records


@pytest.mark.parametrize("layer", [0, 15, 29])
def test_kept_indices_on_captured_tensors_equal_the_reference(captured, layer):
    record = captured[layer]
    keys, queries = record["keys"], record["window_queries"]
    assert record["budget"] == BUDGET and keys.shape[1] == max(PROMPT_LENS)
    scores = reference_scores(keys, queries, WINDOW, KERNEL)
    length, heads = keys.shape[1], keys.shape[0]
    expected = reference_keep(reference_ada_counts(scores, BUDGET - WINDOW, 0.5), scores, length, WINDOW)
    assert [k.tolist() for k in record["kept"]] == expected, "the engine's choice"
    prompt = PromptKV(keys, queries, layer, record["num_layers"])
    snapkv = make_policy("snapkv").keep(prompt, BUDGET)
    assert [k.tolist() for k in snapkv] == reference_keep([BUDGET - WINDOW] * heads, scores, length, WINDOW)
    capacity = reference_pyramid(BUDGET - WINDOW, length - WINDOW, layer, record["num_layers"])
    pyramid = make_policy("pyramid").keep(prompt, BUDGET)
    assert [k.tolist() for k in pyramid] == reference_keep([capacity] * heads, scores, length, WINDOW)


#: A 16-block pool of ``mib_block_model`` and 200 output tokens each: vLLM must preempt and recompute.
TIGHT = (*POOL_16_BLOCKS, "--max-tokens", "200")


def test_preempted_relocated_requests_recompute_like_stock(engine_run, mib_block_model):
    """identity relocates but drops nothing, so through preemption it must give stock vLLM's tokens. With
    vLLM's admission (``--no-reserve-growth``): kvpolicy's would keep its growth free and not preempt.

    Not bitwise in logprobs: stock vLLM itself is not, run to run, once it
    preempts (we saw the last steps of a request differ between two stock runs).
    """
    preempting = (*POOL_16_BLOCKS, "--max-tokens", "150")  # stock preempts by 150 tokens
    stock = engine_run("--stock", *preempting, model=mib_block_model)
    identity = engine_run("--policy", "identity", *preempting, "--no-reserve-growth", model=mib_block_model)
    assert stock["preemptions"] > 0 and identity["preemptions"] == stock["preemptions"]
    for i, (a, b) in enumerate(zip(stock["requests"], identity["requests"])):
        assert a["token_ids"] == b["token_ids"], f"request {i}: tokens differ"
        for step_a, step_b in zip(a["logprobs"], b["logprobs"]):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-3 for t in step_a)
    assert identity["kv_cache_usage_end"] == 0.0


def test_preemption_recompresses_and_returns_every_block(engine_run, mib_block_model):
    run = engine_run(
        "--policy", "adasnap", "--budget", str(BUDGET), *TIGHT, "--no-reserve-growth", model=mib_block_model
    )
    compressible = sum(n > BUDGET for n in PROMPT_LENS)
    assert run["preemptions"] > 0
    assert run["counters"]["compressed_requests"] > compressible, "a preempted request is compressed again"
    assert all(len(r["token_ids"]) == 200 for r in run["requests"])
    assert run["kv_cache_usage_end"] == 0.0


def test_admission_that_reserves_growth_leaves_nothing_to_preempt(engine_run, mib_block_model):
    """The same tight pool: admitting only while compressed requests' growth stays free, vLLM never preempts."""
    adasnap = ("--policy", "adasnap", "--budget", str(BUDGET), *TIGHT)
    run = engine_run(*adasnap, model=mib_block_model)
    assert run["preemptions"] == 0
    assert engine_run(*adasnap, "--no-reserve-growth", model=mib_block_model)["preemptions"] > 0
    assert all(len(r["token_ids"]) == 200 for r in run["requests"])
    assert run["kv_cache_usage_end"] == 0.0
