"""vLLM's asynchronous scheduler gives kvpolicy's policies what its synchronous one gives, bit for bit.

That scheduler (vLLM's CUDA default) schedules step N+1 before it reads step N's block releases
(``kvpolicy/vllm/scheduler/connector.py``); with prefix caching, the blocks step N may rewrite leave the cache when N
is scheduled. vLLM's CPU platform turns it off; ``engine_run.py --async-scheduling`` turns it back on, and vLLM's
engine core, scheduler and model runner run it on CPU as on a GPU. The runs are those of the first GPU check: the tiny
model of head size 64, 32-token blocks, a 256 MiB pool. There, before the fix, ``identity``'s 256-token request took
its first decode token into a block the release had just freed, and a request that crossed a block boundary 13 steps
later wrote three tokens over it.
"""

import pytest

from kvpolicy.offline.model import prepare_tiny
from kvpolicy.vllm.metrics import GAUGES
from tests.e2e.conftest import assert_same_outputs, shared_prefix_args
from tests.e2e.test_ops_in_engine import assert_the_policy_acted

BLOCK_SIZE = 128  # the default model's on CPU

RUN = ("--block-size", "32", "--pool-mib", "256")
#: Memory snapshots of the last step's report: the worker learns of finished requests a step later
#: under the asynchronous scheduler, so the last snapshot may still count them.
SNAPSHOTS = {name.removeprefix("vllm:kvpolicy_") for name, _, _ in GAUGES.values()}
POLICIES = {
    "identity": ("--policy", "identity"),  # keeps every token; releases nothing
    "adasnap": ("--policy", "adasnap", "--budget", "128"),  # compresses each prompt once, releases its tail
    "keydiff": ("--policy", "keydiff", "--budget", "128"),  # evicts at every prompt chunk
    "h2o": ("--policy", "h2o", "--budget", "128"),  # evicts in decode too
}


@pytest.fixture(scope="module")
def tiny_model():
    return prepare_tiny(num_layers=3, num_heads=4, num_kv_heads=2, head_size=64)


@pytest.mark.engine
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_asynchronous_scheduling_gives_the_synchronous_tokens_logprobs_and_counters(engine_run, tiny_model, policy):
    synchronous = engine_run(*POLICIES[policy], *RUN, model=tiny_model)
    asynchronous = engine_run(*POLICIES[policy], *RUN, "--async-scheduling", model=tiny_model)
    assert (synchronous["async_scheduling"], asynchronous["async_scheduling"]) == (False, True)
    assert_the_policy_acted(policy, synchronous["counters"])
    for i, (a, b) in enumerate(zip(synchronous["requests"], asynchronous["requests"], strict=True)):
        assert a == b, f"request {i} differs"
    totals = [{k: v for k, v in run["counters"].items() if k not in SNAPSHOTS} for run in (synchronous, asynchronous)]
    assert totals[0] == totals[1]
    assert asynchronous["kv_cache_usage_end"] == 0


#: A 2,000-token prefix, then two prompts sharing it (the first alone, then the other), on the default model:
#: per policy the flags of its run, and the blocks the second prompt finds cached under each scheduler.
PREFIX_RUNS = {
    # The bound evicts one block more than the kept ones the synchronous report names.
    "adasnap": (("--prompt-lens", "100", "150"), 13, 12),
    # Evicts chunk by chunk and reads no prefix cache, but its blocks must still leave it before reuse.
    "keydiff": (("--prompt-lens", "100", "150"), 0, 0),
    "pod": (("--recent-tokens", "128", "--pod-delta", "0.5", "--prompt-lens", "100", "150"), 3, 3),
    "omnikv": (("--offload", "1", "--prompt-lens", "100", "150"), 10, 10),
}


@pytest.mark.engine
@pytest.mark.parametrize("policy", sorted(PREFIX_RUNS))
def test_with_prefix_caching_the_asynchronous_scheduler_gives_the_synchronous_outputs(engine_run, policy):
    """The blocks a step rewrites leave the prefix cache when the step is scheduled (kvpolicy/vllm/scheduler/rewrite_bounds.py),
    so no request scheduled before the step's report hits them: the outputs are the synchronous scheduler's,
    and the second prompt still finds the first's untouched blocks."""
    flags, synchronous_blocks, asynchronous_blocks = PREFIX_RUNS[policy]
    args = shared_prefix_args(policy, *flags, "--prefix-caching")
    synchronous = engine_run(*args)
    asynchronous = engine_run(*args, "--async-scheduling")
    assert (synchronous["async_scheduling"], asynchronous["async_scheduling"]) == (False, True)
    for run in (synchronous, asynchronous):
        assert_the_policy_acted(policy, run["counters"])
    assert_same_outputs(synchronous, asynchronous)
    cached = [run["requests"][1]["cached_tokens"] for run in (synchronous, asynchronous)]
    assert cached == [synchronous_blocks * BLOCK_SIZE, asynchronous_blocks * BLOCK_SIZE]
    assert asynchronous["kv_cache_usage_end"] == 0
