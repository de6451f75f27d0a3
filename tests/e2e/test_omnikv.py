"""OmniKV in the real engine: with every page selected it is stock vLLM bit for bit; with a small budget
the sparse layers really read fewer pages; a filter layer the model lacks is refused at startup. With
--kv-offload the outputs stay the same while blocks go back to vLLM, through preemption too."""

from tests.e2e.conftest import POOL_16_BLOCKS
from tests.e2e.engine_run import PROMPT_LENS

#: Below the longest request (1100 prompt + 24 output tokens), so its decode takes the sparse path, yet
#: ceil(1025 / 128) = 9 pages: every page it has (block size 128).
EVERY_PAGE = ("--policy", "omnikv", "--budget", "1025")


def test_selecting_every_page_is_bitwise_identical_to_stock(engine_run):
    stock, ours = engine_run("--stock"), engine_run(*EVERY_PAGE)
    counters = ours["counters"]
    assert counters["context_pages"] > 0, "the longest request decoded on the sparse path"
    assert counters["selected_pages"] == counters["context_pages"]
    for i, (a, b) in enumerate(zip(stock["requests"], ours["requests"])):
        assert a == b, f"request {i}: tokens or logprobs differ"


def test_a_small_budget_reads_fewer_pages_and_holds_nothing_after(engine_run):
    run = engine_run("--policy", "omnikv", "--budget", "256")
    counters = run["counters"]
    assert 0 < counters["selected_pages"] < counters["context_pages"]
    assert counters.get("released_blocks", 0) == 0, "omnikv drops nothing"
    assert run["kv_cache_usage_end"] == 0.0
    stock = engine_run("--stock")["requests"]
    for i, n in enumerate(PROMPT_LENS):
        if n + 24 <= 256:
            assert run["requests"][i] == stock[i], f"request {i} ({n} tokens) never passed its budget"


def test_a_filter_layer_the_model_lacks_is_refused_before_loading(engine_run):
    stderr = engine_run("--policy", "omnikv", "--budget", "256", "--filter-layers", "2,40", fails=True)
    assert "--kv-filter-layers [40] out of range" in stderr
    assert "python -m kvpolicy.offline.calibrate" in stderr


#: Prompts that cross a page boundary while decoding (1140 + 40 > 9 pages, 380 + 40 > 3 pages), so the
#: sparse layers' full tail pages go to the host pool mid-decode.
CROSSING = ("--prompt-lens", "40", "1140", "700", "380", "--max-tokens", "40")
SPARSE = ("--policy", "omnikv", "--budget", "256", *CROSSING)


def test_offload_gives_the_same_outputs_and_returns_blocks_to_vllm(engine_run):
    resident, offloaded = engine_run(*SPARSE), engine_run(*SPARSE, "--offload", "1")
    counters = offloaded["counters"]
    assert counters["offloaded_requests"] == 3, "every prompt over the budget moved to the host pool"
    # At the offload, 22 sparse layers x 3 heads x (8 + 5 + 2) completed pages; then two tails fill.
    assert counters["offloaded_kv_pages"] == 22 * 3 * (8 + 5 + 2) + 2 * 22 * 3
    assert counters["loaded_kv_pages"] > 0 and counters["offload_refused"] == 0
    assert counters["released_blocks"] > 0, "the offloaded requests hold fewer of vLLM's blocks"
    assert offloaded["kv_cache_usage_end"] == 0.0
    assert counters["selected_pages"] == resident["counters"]["selected_pages"]
    for i, (a, b) in enumerate(zip(resident["requests"], offloaded["requests"])):
        assert a == b, f"request {i}: tokens or logprobs differ with --kv-offload"


def test_requests_the_host_pool_cannot_take_stay_resident_beside_offloaded_ones(engine_run):
    # 0.07 GiB holds 1146 pages of 64 KiB; a request reserves 22 x 3 x 15 = 990 (up to 2048 tokens).
    resident, mixed = engine_run(*SPARSE), engine_run(*SPARSE, "--offload", "0.07")
    counters = mixed["counters"]
    assert counters["offloaded_requests"] == 1 and counters["offload_refused"] == 2
    assert mixed["kv_cache_usage_end"] == 0.0
    for i, (a, b) in enumerate(zip(resident["requests"], mixed["requests"])):
        assert a == b, f"request {i}: tokens or logprobs differ in a batch of offloaded and resident rows"


#: A 16-block pool of ``mib_block_model`` for the default prompts (23 blocks in all) and 150 output tokens each; its
#: 8 layers as the default model's 30: the first dense, filter layers that attend to everything, the rest sparse.
TIGHT = ("--policy", "omnikv", "--budget", "256", "--dense-layers", "1", "--filter-layers", "1,4", *POOL_16_BLOCKS)


def test_blocks_offload_returns_let_vllm_run_without_preempting(engine_run, mib_block_model):
    resident = engine_run(*TIGHT, "--max-tokens", "150", model=mib_block_model)
    offloaded = engine_run(*TIGHT, "--max-tokens", "150", "--offload", "1", model=mib_block_model)
    assert resident["preemptions"] > 0, "the resident path needs more blocks than the pool has"
    assert offloaded["preemptions"] == 0 and offloaded["counters"]["released_blocks"] > 0
    for i, (a, b) in enumerate(zip(resident["requests"], offloaded["requests"])):
        assert a["token_ids"] == b["token_ids"], f"request {i}: tokens differ"


def test_preempted_offloaded_requests_are_offloaded_again_and_every_block_returns(engine_run, mib_block_model):
    run = engine_run(*TIGHT, "--max-tokens", "350", "--offload", "1", model=mib_block_model)
    assert run["preemptions"] > 0
    assert run["counters"]["offloaded_requests"] > 3, "a recomputed request moves to the host pool again"
    assert run["kv_cache_usage_end"] == 0.0
