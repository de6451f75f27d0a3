"""KeyDiff's block prompt processing in the engine: it evicts at every prefill chunk, so a request holds
about its budget plus one chunk, and a prompt three times the whole KV pool completes where stock
vLLM refuses to start."""

import math

BUDGET, CHUNK, BLOCK = 256, 512, 128
#: 17 MiB of ``mib_block_model``'s KV: 17 blocks, 2,176 tokens.
POOL = ("--pool-mib", "17", "--max-model-len", "8192", "--chunk", str(CHUNK))
POOL_TOKENS = 2176
LONG = 6600
OUTPUT = 160
LAYERS_X_HEADS = 8 * 4


def test_keydiff_completes_a_prompt_three_times_the_pool(engine_run, mib_block_model):
    assert LONG > 3 * POOL_TOKENS
    run = engine_run(
        "--policy",
        "keydiff",
        "--budget",
        str(BUDGET),
        *POOL,
        "--prompt-lens",
        str(LONG),
        "--max-tokens",
        str(OUTPUT),
        model=mib_block_model,
    )
    counters = run["counters"]
    assert len(run["requests"][0]["token_ids"]) == OUTPUT
    chunks = math.ceil(LONG / CHUNK)
    decode_passes = 1  # 159 decode tokens: one page's worth over the budget
    assert counters["eviction_passes"] == chunks - 1 + decode_passes, "every chunk but the last, then as pages fill"
    assert counters["peak_request_kv_blocks"] <= math.ceil((BUDGET + CHUNK) / BLOCK) + 1, "budget + chunk + spare"
    assert counters["kept_kv_tokens"] == BUDGET * LAYERS_X_HEADS
    assert run["kv_cache_usage_end"] == 0.0


def test_stock_path_refuses_the_same_pool_with_vllms_message(engine_run, mib_block_model):
    stderr = engine_run(
        "--policy", "none", *POOL, "--prompt-lens", str(LONG), "--max-tokens", "16", fails=True, model=mib_block_model
    )
    assert "To serve at least one request with the model's max seq len (8192)" in stderr
