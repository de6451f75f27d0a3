"""Pipeline parallelism through vLLM: two stages, each compressing its own layers.

The small random-weight Llama of the tensor-parallel test (4 layers), one stage per core: each stage holds, scores and
packs its own two layers, and Ada-KV allocates per layer, so nothing crosses stages. Two stages keep what one engine
keeps: the same tokens, the same counts, each request counted once in the metrics, every block free after.

KeyDiff evicts at the end of every chunk a prompt is read in, so its result depends on where the chunks end; vLLM keeps
a batch in flight per stage and schedules around it, which moves the chunk ends of prompts read over several steps. Its
prompts here fit one step, as on one engine.
"""

import pytest

from kvpolicy.offline.model import prepare_tiny
from kvpolicy.vllm.metrics import PER_REQUEST
from tests.e2e.test_ops_in_engine import assert_same_tokens

pytestmark = pytest.mark.engine

RUNS = {
    "adasnap": ("--policy", "adasnap", "--budget", "64", "--max-tokens", "12"),
    "keydiff": (
        "--policy",
        "keydiff",
        "--budget",
        "64",
        "--max-tokens",
        "12",
        "--chunk",
        "2048",
        "--prompt-lens",
        "40",
        "300",
        "700",
        "129",
        "256",
    ),
}
COUNTS = (
    *sorted(PER_REQUEST - {"offloaded_requests", "offload_refused", "pod_layouts"}),
    "kept_kv_tokens",
    "prompt_kv_tokens",
)


@pytest.fixture(scope="module")
def four_layers():
    return prepare_tiny(num_layers=4, num_heads=8, num_kv_heads=4, head_size=64)


@pytest.mark.parametrize("policy", sorted(RUNS))
def test_two_stages_compress_like_one_engine(engine_run, four_layers, policy):
    one = engine_run(*RUNS[policy], model=four_layers)
    two = engine_run(*RUNS[policy], "--pipeline-parallel", "2", model=four_layers)
    assert two["counters"]["compressed_requests"] > 0
    for key in COUNTS:
        assert two["counters"][key] == one["counters"][key], key
    assert_same_tokens(one, two)
    assert two["kv_cache_usage_end"] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (("--policy", "omnikv", "--budget", "64"), "its filter layers choose the pages the later layers read"),
        (("--policy", "adasnap", "--budget", "64", "--prefix-caching"), "drop --enable-prefix-caching"),
    ],
)
def test_what_needs_another_stage_is_refused_at_startup(engine_run, four_layers, args, message):
    assert message in engine_run(*args, "--pipeline-parallel", "2", fails=True, model=four_layers)
