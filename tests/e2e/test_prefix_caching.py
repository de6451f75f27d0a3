"""Prefix caching with compressing policies, on the real engine (a chat through the real server: test_server.py).

A prompt that starts with a cached prefix reads it from the blocks an earlier request handed back, computes the rest,
and is then compressed over its whole prompt: its output equals the output with prefix caching off. Blocks a relocated
request keeps leave the prefix cache, so no later prompt is served relocated pages; PoD's layout and OmniKV's offload
also write only the request's own blocks. H2O/D2O (scores from every prompt query) and KeyDiff (evicts chunk by chunk)
do not read the prefix cache: their outputs equal too, with no hits. A prompt whose blocks are mostly shared with
running requests has no room of its own to relocate into and stays uncompressed.
"""

import pytest

from tests.e2e.conftest import assert_same_outputs, shared_prefix_args

BLOCK_SIZE = 128


def shared_prefix_runs(engine_run, policy: str, *flags: str) -> tuple[dict, dict]:
    """The same prompts (a 2,000-token prefix, then their own tails; the first alone, then the rest at
    once) with prefix caching off and on."""
    args = shared_prefix_args(policy, *flags)
    return engine_run(*args), engine_run(*args, "--prefix-caching")


def test_a_prompt_after_a_cached_prefix_hits_it_and_compresses_to_the_same_output(engine_run):
    off, on = shared_prefix_runs(engine_run, "adasnap", "--prompt-lens", "100", "150")
    first, second = (request["cached_tokens"] for request in on["requests"])
    assert first == 0
    # The first request wrote its kept pages into its last blocks and handed its first ones back, cached.
    assert second >= 12 * BLOCK_SIZE and on["prefix_cache_hits"] == second
    assert off["prefix_cache_hits"] == 0
    assert on["counters"]["relocated_requests"] == off["counters"]["relocated_requests"] == 2
    assert on["counters"]["released_blocks"] == off["counters"]["released_blocks"]
    assert_same_outputs(off, on)
    assert on["kv_cache_usage_end"] == 0


@pytest.mark.parametrize(
    "policy, counter, cached_blocks",
    [
        # The lowest layers keep every token: the first layout holds 14 of its 17 blocks, the last ones
        # (the paper's δ 0.5; the shipped 0.65 shares too few layers to free a block at these lengths).
        (("pod", "--recent-tokens", "128", "--pod-delta", "0.5"), "pod_layouts", 3),
        # 8 full layers' pages, 22 sparse layers' tail and staging pages, a spare block: 7 of 17.
        (("omnikv", "--offload", "1"), "offloaded_requests", 10),
    ],
    ids=["pod", "omnikv-offload"],
)
def test_layouts_over_every_layer_after_a_cached_prefix_hit_it_to_the_same_output(
    engine_run, policy, counter, cached_blocks
):
    """PoD's layout and OmniKV's offload fill the request's own block, then its cached ones from the end:
    the first blocks stay cached for the next prompt."""
    off, on = shared_prefix_runs(engine_run, policy[0], *policy[1:], "--prompt-lens", "100", "150")
    first, second = (request["cached_tokens"] for request in on["requests"])
    assert first == 0 and second == cached_blocks * BLOCK_SIZE and on["prefix_cache_hits"] == second
    assert on["counters"][counter] == off["counters"][counter] == 2
    assert on["counters"]["released_blocks"] == off["counters"]["released_blocks"] > 0
    assert_same_outputs(off, on)
    assert on["kv_cache_usage_end"] == 0


def test_pod_layouts_in_decode_never_write_blocks_a_running_request_reads(engine_run):
    """Prompts under PoD's layout length (16 sinks + 128 recent + a page: 272) are laid out as they decode.
    The two last prompts run together, each reading the first prompt's cached block: the block both read
    leaves too few of their own for a layout, so they stay on the stock path, with stock's tokens."""
    args = (
        "--max-model-len",
        "4096",
        "--shared-prefix",
        "200",
        "--prompt-lens",
        "20",
        "60",
        "70",
        "--max-tokens",
        "40",
        "--prefix-caching",
    )
    pod = engine_run("--policy", "pod", "--recent-tokens", "128", *args)
    stock = engine_run("--policy", "none", *args)
    assert [request["cached_tokens"] for request in pod["requests"]] == [0, BLOCK_SIZE, BLOCK_SIZE]
    assert pod["counters"].get("pod_layouts", 0) == 0
    assert pod["counters"]["shared_prefix_uncompressed"] == 2
    assert_same_outputs(stock, pod)
    assert pod["kv_cache_usage_end"] == 0


@pytest.mark.parametrize("policy", ["h2o", "keydiff"])
def test_policies_that_cannot_start_from_a_hit_do_not_read_the_cache(engine_run, policy):
    off, on = shared_prefix_runs(engine_run, policy, "--prompt-lens", "100", "150")
    assert on["prefix_cache_hits"] == 0
    assert [request["cached_tokens"] for request in on["requests"]] == [0, 0]
    assert on["counters"]["released_blocks"] == off["counters"]["released_blocks"] > 0
    assert_same_outputs(off, on)
    assert on["kv_cache_usage_end"] == 0


def test_prompts_mostly_shared_with_running_ones_stay_uncompressed_and_exact(engine_run):
    lens = ("--prompt-lens", "100", "150", "200", "--prefix-caching")
    on, stock = (engine_run(*shared_prefix_args(policy, *lens)) for policy in ("adasnap", "none"))
    # The two last prompts run together: each reads the other's blocks, 2 of their own are left.
    assert [request["cached_tokens"] > 0 for request in on["requests"]] == [False, True, True]
    assert on["counters"]["shared_prefix_uncompressed"] == 2
    assert on["counters"]["relocated_requests"] == 1
    assert_same_outputs({"requests": stock["requests"][1:]}, {"requests": on["requests"][1:]})
    assert on["kv_cache_usage_end"] == 0
