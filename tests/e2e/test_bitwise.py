"""``--kv-policy none`` and ``identity`` are bitwise identical to stock vLLM (split-KV off, one attention thread).

Each engine runs in its own process (``engine_run.py``) on the same mixed
batch: six prompts of 40 to 1100 tokens, chunked prefill at 256 tokens per
step, so relocated requests decode beside stock prefills in one step.
``engine_run.py`` says why one thread, in-process.
"""

import pytest

STOCK = ("--stock",)


@pytest.mark.parametrize("policy", ["none", "identity"])
def test_tokens_and_logprobs_are_bitwise_identical_to_stock(engine_run, policy):
    stock, ours = engine_run(*STOCK)["requests"], engine_run("--policy", policy)["requests"]
    assert len(ours) == len(stock) == 6
    for i, (a, b) in enumerate(zip(stock, ours)):
        assert a["token_ids"] == b["token_ids"], f"request {i}: tokens differ"
        assert a["logprobs"] == b["logprobs"], f"request {i}: logprobs differ"


def test_identity_really_took_the_per_head_path(engine_run):
    identity = engine_run("--policy", "identity")
    assert identity["counters"]["relocated_requests"] == 6
    assert identity["counters"]["released_blocks"] == 0
    assert engine_run("--policy", "none")["counters"].get("relocated_requests", 0) == 0
