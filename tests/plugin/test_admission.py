"""The startup KV check judges an evicting policy by what one request can hold, not by --max-model-len."""

from types import SimpleNamespace

from kvpolicy.config import KVPolicyConfig
from kvpolicy.vllm.admission import SLACK_BLOCKS, _needed_for_bound, request_kv_bound


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
    needed = _needed_for_bound(lambda config: config.model_config.max_model_len)
    keydiff = vllm_config("keydiff", 256)
    assert needed(keydiff) == 256 + 512 + SLACK_BLOCKS * 128
    assert keydiff.model_config.max_model_len == 8192
    assert needed(vllm_config("adasnap", 256)) == 8192
    assert needed(vllm_config("keydiff", 256, max_model_len=1024)) == 1024
