"""Short prompts, long outputs: decode takes a prompt within its budget past it, and the policy brings it back.

Prompts of 100 and 60 tokens under a 128-token budget, 32-token blocks (the smallest the CPU attention
takes) and 150 output tokens: the default policy (adamix) relocates each request at its 161st token, the
first of a page past budget and buffer (one page), and passes again every page (at 193 and 225 tokens);
keydiff relocates a page past the budget (160 tokens) and evicts a page at a time from there
(``decode_passes.py``). Stock vLLM holds 8 blocks for the longer request by its end; these hold at
most the budget and buffer's 5 pages a head, one part-filled and a spare block.
"""

import pytest

from kvpolicy.offline.model import prepare_tiny
from tests.e2e.test_ops_in_engine import OTHER_OPS, assert_same_tokens

PROMPTS = ("--prompt-lens", "100", "60", "--block-size", "32", "--max-tokens", "150")
BUDGET = ("--budget", "128")
#: Output tokens before any pass: the 161st token of the longer request's cache is its 61st output token.
BEFORE_FIRST_PASS = 161 - 100
#: The budget and buffer's 5 pages a head, a page part-filled at a pass.
MOST_BLOCKS = 6


def first_tokens(run: dict, count: int) -> list[list[int]]:
    return [r["token_ids"][:count] for r in run["requests"]]


@pytest.mark.engine
@pytest.mark.parametrize("policy, passes", [("adamix", 3), ("adaheavy", 3), ("rkv", 3), ("keydiff", 3)])
def test_decode_holds_a_short_prompt_at_its_budget_and_gives_blocks_back(engine_run, policy, passes):
    """Both requests relocated once, in decode; then a pass each page; tokens up to the first pass are stock
    vLLM's, bit for bit in their logprobs (the pass runs after the step's attention); every block comes back."""
    stock = engine_run("--stock", *PROMPTS)
    run = engine_run("--policy", policy, *BUDGET, *PROMPTS, "--prefix-caching")
    counters = run["counters"]
    assert counters["relocated_requests"] == 2
    assert counters["eviction_passes"] == passes
    assert counters["released_blocks"] > 0
    assert 0 < counters["peak_request_kv_blocks"] <= MOST_BLOCKS < 250 / 32
    assert first_tokens(run, BEFORE_FIRST_PASS) == first_tokens(stock, BEFORE_FIRST_PASS)
    for ours, theirs in zip(run["requests"], stock["requests"]):
        assert ours["logprobs"][: 161 - 100] == theirs["logprobs"][: 161 - 100]
    assert all(len(r["token_ids"]) == 150 for r in run["requests"])
    assert run["kv_cache_usage_end"] == 0.0, "every block is free again after the run"


@pytest.mark.engine
def test_a_preempted_request_is_compressed_again_and_an_abort_returns_every_block(engine_run):
    """A 14-block pool (vLLM's admission, --no-reserve-growth): three requests growing to their first pass do
    not fit, vLLM preempts, the preempted one recomputes in vLLM's layout and is relocated again at its next
    pass. Up to the first pass its tokens are stock vLLM's (greedy); after it, what a request keeps depends
    on where its passes fell. The longest request is aborted on the way: its blocks come back too."""
    stock = engine_run("--stock", *PROMPTS)
    flags = ("--prompt-lens", "100", "60", "100", *PROMPTS[3:], "--pool-mib", "20", "--no-reserve-growth")
    flags += ("--max-model-len", "256")  # what the pool holds at once, for vLLM's start-up check
    run = engine_run("--policy", "adamix", *BUDGET, *flags, "--abort-after", "120")
    assert run["preemptions"] > 0
    assert run["counters"]["relocated_requests"] > 2, "a preempted request is relocated again"
    assert len(run["requests"]) == 2 and all(len(r["token_ids"]) == 150 for r in run["requests"])
    assert first_tokens(run, BEFORE_FIRST_PASS)[0] == first_tokens(stock, BEFORE_FIRST_PASS)[1]  # the 60-token one
    assert run["kv_cache_usage_end"] == 0.0


@pytest.mark.engine
def test_admission_reserves_what_short_prompts_grow_to_before_their_first_pass(engine_run):
    """The same 14-block pool with kvpolicy's admission (the default): each admitted request, and those still
    reading their prompt, keep free the blocks they append until their first pass, so no request is preempted
    (one was preempted here while the admitted request's own growth did not count)."""
    flags = ("--prompt-lens", "100", "60", "100", *PROMPTS[3:], "--pool-mib", "20", "--max-model-len", "256")
    run = engine_run("--policy", "adamix", *BUDGET, *flags)
    assert run["preemptions"] == 0
    assert run["counters"]["relocated_requests"] == 3
    assert all(len(r["token_ids"]) == 150 for r in run["requests"])
    assert run["kv_cache_usage_end"] == 0.0


@pytest.fixture(scope="module")
def tiny_model():
    return prepare_tiny(num_layers=3, num_heads=4, num_kv_heads=2, head_size=32)


@pytest.mark.engine
def test_decode_passes_on_the_cuda_path_agree_with_the_cpu_ops(engine_run, tiny_model):
    """Triton's interpreter on the tiny model, with vLLM's CUDA defaults (asynchronous scheduling, prefix
    caching) and the fixed shapes of full CUDA graphs: a step with a pass or a stashed query leaves them
    (``Relocate.decode_work_due``), the others still run fixed; tokens and counters as the CPU ops'."""
    args = ("--policy", "adamix", "--budget", "24", "--prompt-lens", "20", "30", "--block-size", "32")
    args += ("--max-tokens", "80", "--page-pool", "layer", "--async-scheduling", "--prefix-caching")
    cpu = engine_run(*args, model=tiny_model)
    # The 20-token prompt: relocated at 65 tokens, a pass at 97; the 30-token one, over the budget, at its end.
    assert cpu["counters"]["relocated_requests"] == 2 and cpu["counters"]["eviction_passes"] == 1
    fixed = engine_run(*args, *OTHER_OPS["triton"][0], "--fixed-decode", model=tiny_model)
    assert_same_tokens(cpu, fixed)
    assert fixed["counters"] == cpu["counters"]
    assert fixed["kv_cache_usage_end"] == 0.0
    assert sum(fixed["fixed_decode_steps"].values()) > 0, "steps without a pass or a stash still run fixed"
