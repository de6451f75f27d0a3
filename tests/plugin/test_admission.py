"""The startup KV check judges an evicting policy by what one request can hold, not by --max-model-len."""

from types import SimpleNamespace

from kvpolicy.config import KVPolicyConfig
from kvpolicy.vllm.patches import judged_on_bound
from kvpolicy.vllm.startup.admission import SLACK_BLOCKS, request_kv_bound


def vllm_config(policy: str, budget: int | None, max_model_len: int = 8192):
    config = KVPolicyConfig(policy=policy, budget=budget)
    return SimpleNamespace(
        additional_config={KVPolicyConfig.ADDITIONAL_CONFIG_KEY: config.to_dict()},
        scheduler_config=SimpleNamespace(max_num_batched_tokens=512),
        cache_config=SimpleNamespace(block_size=128),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )


def test_only_policies_that_evict_while_reading_are_bounded():
    assert request_kv_bound(vllm_config("keydiff", 256)) == 256 + 512 + SLACK_BLOCKS * 128
    assert request_kv_bound(vllm_config("adasnap", 256)) is None
    assert request_kv_bound(vllm_config("none", None)) is None


def test_the_check_sees_the_bound_and_the_config_is_restored():
    needed = judged_on_bound(lambda config: config.model_config.max_model_len, request_kv_bound)
    keydiff = vllm_config("keydiff", 256)
    assert needed(keydiff) == 256 + 512 + SLACK_BLOCKS * 128
    assert keydiff.model_config.max_model_len == 8192
    assert needed(vllm_config("adasnap", 256)) == 8192
    assert needed(vllm_config("keydiff", 256, max_model_len=1024)) == 1024


def test_one_growing_request_reserves_the_blocks_it_will_append():
    from kvpolicy.vllm.scheduler.reservations import GrowingRequest, blocks_to_reserve

    # 3,000 tokens in 24 block-table entries (4 live after compression), 1,024 tokens to go: 4,024 fill 32.
    assert blocks_to_reserve([GrowingRequest(live=4, table=24, length=3000, left=1024)], 128) == 8
    assert blocks_to_reserve([], 128) == 0


def test_requests_that_finish_first_give_back_what_the_others_still_need():
    from kvpolicy.vllm.scheduler.reservations import GrowingRequest, blocks_to_reserve

    early = GrowingRequest(live=10, table=30, length=3768, left=256)  # appends 2 more, then frees 12
    late = GrowingRequest(live=4, table=24, length=3000, left=1024)  # appends 2 by then, 8 in all
    # The worst moment is just before the early one finishes: 2 + 2 blocks taken; after it, 8 - 12 < 4.
    assert blocks_to_reserve([early, late], 128) == 4
    assert blocks_to_reserve([late, late], 128) == 16


def test_a_prompt_being_read_reserves_the_rest_of_it_or_what_it_grows_to_after_its_rewrite():
    from kvpolicy.vllm.scheduler.reservations import blocks_to_read

    # 1,100 tokens admitted with a 256-token chunk (2 blocks): 7 more until its read ends, the worst moment,
    # since after it it keeps 3 and appends 2 (1,300 tokens fill 11).
    assert blocks_to_read(read=1100, kept=3, final=1300, table=2, block_size=128) == 7
    # 256 tokens kept in 2 blocks that grow to 456 (4 more entries, 2 appended): 2 + 2 = 4 at its end.
    assert blocks_to_read(read=256, kept=2, final=456, table=1, block_size=128) == 3
    assert blocks_to_read(read=256, kept=2, final=256, table=2, block_size=128) == 0
