"""Option validation: every rejection names what to change."""

import pytest

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError, check_flag
from kvpolicy.policies import POLICIES, IdentityPolicy, PromptKV


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(
        KVPolicyConfigError,
        match="choose one of: adaheavy, adamix, adapyramid, adasnap, d2o, h2o, identity, keydiff, none, omnikv, pod, pyramid, rkv, snapkv, streaming",
    ):
        KVPolicyConfig(policy="bogus")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"budget": 0}, "--kv-budget must be a positive"),
        ({"ratio": 1.5}, r"--kv-ratio .* in \(0, 1\]"),
        ({"budget": 10, "ratio": 0.5}, "not both"),
        ({"pool_kernel": 4}, "positive odd"),
        ({"window": 0}, "--kv-window must be positive"),
        ({"page_pool": "request"}, "--kv-page-pool is model or layer"),
    ],
)
def test_bad_values_are_rejected(options, message):
    with pytest.raises(KVPolicyConfigError, match=message):
        KVPolicyConfig(policy="identity", **options)


@pytest.mark.parametrize(
    "policy, options, message",
    [
        ("snapkv", {"budget": True}, r"--kv-budget takes an integer, not a boolean \(got True\)"),
        ("snapkv", {"ratio": True}, r"--kv-ratio takes a number, not a boolean"),
        ("omnikv", {"budget": 128, "offload": False}, r"--kv-offload takes a number, not a boolean"),
        ("snapkv", {"budget": 128, "window": True}, r"--kv-window takes an integer, not a boolean"),
        ("pod", {"pod_tau": True}, r"--kv-pod-tau takes a number, not a boolean"),
        ("omnikv", {"budget": 128, "filter_layers": (True, 3)}, r"--kv-filter-layers takes layer indices, not a"),
        ("h2o", {"options": {"recent_fraction": True}, "budget": 128}, "--kv-recent-fraction takes a number"),
    ],
)
def test_a_boolean_is_not_a_number(policy, options, message):
    """Python counts True as 1, and JSON's true arrives as it: every number option refuses it by name
    (``--kv-budget true`` would otherwise keep one token, and ``--kv-window true`` pass as 1)."""
    with pytest.raises(KVPolicyConfigError, match=message):
        KVPolicyConfig(policy=policy, **options)


def test_a_boolean_flag_is_refused_on_its_own():
    with pytest.raises(KVPolicyConfigError, match="--kv-budget takes an integer, not a boolean"):
        check_flag("budget", True)
    with pytest.raises(KVPolicyConfigError, match="--kv-pod-tau takes a number, not a boolean"):
        check_flag("pod_tau", False)
    check_flag("merge", False)  # a switch takes one


def test_offload_is_an_omnikv_host_pool_size():
    with pytest.raises(KVPolicyConfigError, match="--kv-offload applies to --kv-policy omnikv, not snapkv"):
        KVPolicyConfig(policy="snapkv", budget=256, offload=1.0)
    with pytest.raises(KVPolicyConfigError, match="size in GiB, > 0"):
        KVPolicyConfig(policy="omnikv", budget=256, offload=0.0)
    assert KVPolicyConfig(policy="omnikv", budget=256, offload=2.0).rewrites_blocks
    assert not KVPolicyConfig(policy="omnikv", budget=256).rewrites_blocks


def test_page_pool_is_for_policies_that_relocate_pages():
    for policy in ("omnikv", "pod"):  # omnikv relocates nothing; PoD's layout always spans every layer
        with pytest.raises(
            KVPolicyConfigError,
            match=f"--kv-page-pool applies to --kv-policy adaheavy, adamix.* snapkv, streaming, not {policy}",
        ):
            KVPolicyConfig(policy=policy, budget=256 if policy == "omnikv" else None, page_pool="layer")
    assert KVPolicyConfig(policy="pyramid", budget=256, page_pool="layer").page_pool == "layer"


def test_budget_larger_than_the_context_is_rejected():
    with pytest.raises(KVPolicyConfigError, match="larger than --max-model-len 4096"):
        KVPolicyConfig(policy="identity", budget=5000).check_model_len(4096)


def test_round_trip_through_additional_config():
    config = KVPolicyConfig(policy="identity", budget=128)
    assert KVPolicyConfig.from_dict(config.to_dict()) == config
    with pytest.raises(KVPolicyConfigError, match="unknown kv_policy options"):
        KVPolicyConfig.from_dict({"policy": "none", "budgte": 3})


def test_only_none_keeps_the_stock_layout():
    assert not KVPolicyConfig(policy="none").compresses
    assert KVPolicyConfig(policy="identity").compresses
    assert {"none", "identity", "snapkv", "adasnap", "pyramid", "adapyramid", "streaming"} <= set(POLICIES)


def test_identity_keeps_every_token_of_every_head():
    import torch

    keep = IdentityPolicy().keep(PromptKV(torch.zeros(3, 5, 4)), budget=2)
    assert [k.tolist() for k in keep] == [list(range(5))] * 3


def test_compressing_policies_need_a_budget():
    with pytest.raises(KVPolicyConfigError, match="--kv-policy adasnap needs --kv-budget or --kv-ratio"):
        KVPolicyConfig(policy="adasnap")
    with pytest.raises(KVPolicyConfigError, match="larger than the observation window"):
        KVPolicyConfig(policy="snapkv", budget=32)


def test_budget_for_a_prompt():
    config = KVPolicyConfig(policy="adasnap", budget=256)
    assert config.budget_for(3000) == 256
    assert config.budget_for(256) is None, "a prompt within budget is not compressed"
    assert config.budget_for(3000, override=100) == 100
    assert KVPolicyConfig(policy="adasnap", ratio=0.1).budget_for(3000) == 300
    assert KVPolicyConfig(policy="identity").budget_for(3000) is None


def test_a_prompt_within_its_budget_has_a_decode_budget_unless_the_buffer_is_0():
    config = KVPolicyConfig(policy="adamix", budget=256)
    assert config.decode_budget(200) == 256 and config.decode_budget(256) == 256
    assert config.decode_budget(3000) is None, "a long prompt is compressed at its end"
    assert config.decode_budget(200, override=64) is None and config.decode_budget(50, override=64) == 64
    assert KVPolicyConfig(policy="adamix", ratio=0.5).decode_budget(200) is None
    assert config.compresses_in_decode and config.moves_after_prompt
    off = KVPolicyConfig(policy="adamix", budget=256, decode_buffer=0)
    assert not off.compresses_in_decode and not off.moves_after_prompt
    assert not KVPolicyConfig(policy="identity").compresses_in_decode
    with pytest.raises(KVPolicyConfigError, match="--kv-decode-buffer must be >= 0"):
        KVPolicyConfig(policy="adamix", budget=256, decode_buffer=-1)
    with pytest.raises(KVPolicyConfigError, match="--kv-decode-buffer applies to --kv-policy adaheavy, adamix"):
        KVPolicyConfig(policy="omnikv", budget=256, decode_buffer=16)


@pytest.mark.parametrize(
    "options, extra, message",
    [
        ({}, {"kv_decode_buffer": -1}, r"kv_decode_buffer must be an integer number of tokens in \[0, 4096\]"),
        ({}, {"kv_decode_buffer": True}, "kv_decode_buffer must be an integer"),
        ({}, {"kv_decode_buffer": 5000}, "kv_decode_buffer must be an integer"),
        ({}, {"kv_policy": "none", "kv_decode_buffer": 16}, "not kv_policy 'none'"),
        ({"decode_buffer": 0}, {"kv_decode_buffer": 16}, "started without --kv-decode-buffer 0"),
    ],
)
def test_a_requests_decode_buffer_is_checked(options, extra, message):
    with pytest.raises(KVPolicyConfigError, match=message):
        KVPolicyConfig(policy="adasnap", budget=256, **options).check_request_options(extra, 4096)
    ok = KVPolicyConfig(policy="adasnap", budget=256, **options).check_request_options({"kv_decode_buffer": 0}, 4096)
    assert ok == {"kv_decode_buffer": 0}


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "positive integer"),
        (2.5, "positive integer"),
        (True, "kv_budget is a number of tokens per KV head, not a boolean \\(got true\\)"),
        (False, "kv_budget is a number of tokens per KV head, not a boolean \\(got false\\)"),
        (20, "observation window"),
        (9000, "context limit"),
    ],
)
def test_per_request_budget_is_validated(value, message):
    with pytest.raises(KVPolicyConfigError, match=message):
        KVPolicyConfig(policy="adasnap", budget=256).check_request_budget(value, 8192)
    with pytest.raises(KVPolicyConfigError, match="applies to compressing policies"):
        KVPolicyConfig(policy="none").check_request_budget(128, 8192)


def test_keydiff_request_budget_cannot_outgrow_the_startup_budget():
    """The pool was sized for --kv-budget; a larger per-request budget could not be held."""
    config = KVPolicyConfig(policy="keydiff", budget=256)
    assert config.check_request_budget(128, 8192) == 128
    with pytest.raises(KVPolicyConfigError, match="larger than --kv-budget 256, which sized the KV pool"):
        config.check_request_budget(512, 8192)


def test_merge_switch_is_d2o_only():
    assert KVPolicyConfig(policy="d2o", budget=128, merge=False).make_policy().merge is False
    with pytest.raises(KVPolicyConfigError, match="--kv-merge applies to d2o, not to --kv-policy h2o"):
        KVPolicyConfig(policy="h2o", budget=128, merge=False)


def test_recent_share_is_h2o_and_d2o_s_and_recent_tokens_pod_s():
    assert KVPolicyConfig(policy="h2o", budget=128).make_policy().recent_fraction == 0.5
    assert KVPolicyConfig(policy="d2o", budget=128, recent_fraction=0.5).make_policy().recent_fraction == 0.5
    with pytest.raises(KVPolicyConfigError, match="--kv-recent-tokens applies to pod, not to --kv-policy h2o"):
        KVPolicyConfig(policy="h2o", budget=128, recent_tokens=64)
    with pytest.raises(KVPolicyConfigError, match="--kv-recent-fraction must be in"):
        KVPolicyConfig(policy="h2o", budget=128, recent_fraction=1.5)


def test_ada_options_reach_the_policies_that_take_them():
    assert KVPolicyConfig(policy="adamix", budget=128, mix=1.0, alpha=1.0).make_policy().mix == 1.0
    assert KVPolicyConfig(policy="adasnap", budget=128, alpha=0.2).make_policy().alpha == 0.2
    with pytest.raises(
        KVPolicyConfigError,
        match="--kv-alpha applies to adaheavy, adamix, adapyramid, adasnap, not to --kv-policy snapkv",
    ):
        KVPolicyConfig(policy="snapkv", budget=128, alpha=0.2)
    with pytest.raises(KVPolicyConfigError, match="--kv-mix must be in"):
        KVPolicyConfig(policy="adamix", budget=128, mix=1.5)
    assert KVPolicyConfig(policy="adamix", budget=128, combine="union").make_policy().combine == "union"
    with pytest.raises(KVPolicyConfigError, match="--kv-combine is blend or union"):
        KVPolicyConfig(policy="adamix", budget=128, combine="max")


def test_pool_kernel_is_the_policys_own_unless_given():
    assert KVPolicyConfig(policy="snapkv", budget=128).make_policy().pool_kernel == 7
    assert KVPolicyConfig(policy="adamix", budget=128).make_policy().pool_kernel == 15
    assert KVPolicyConfig(policy="adamix", budget=128, pool_kernel=7).make_policy().pool_kernel == 7


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"kv_budgt": 128},
            r"unknown request option 'kv_budgt'; kvpolicy takes kv_budget, kv_policy, kv_decode_buffer per request",
        ),
        ({"kv_budget": 128, "kv_ratio": 0.5}, "unknown request option 'kv_ratio'"),
        (
            {"kv_policy": "keydiff"},
            r"kv_policy 'keydiff' cannot be served .*--kv-policy adasnap.*none, adamix, adapyramid, adasnap, pyramid, rkv, snapkv",
        ),
        ({"kv_policy": 3}, "kv_policy 3 cannot be served"),
        ({"kv_policy": "none", "kv_budget": 64}, "kv_budget does not apply to a request with kv_policy 'none'"),
        ({"kv_policy": "snapkv", "kv_budget": 16}, "larger than the observation window"),
        ({"kv_budget": True}, r"kv_budget is a number of tokens per KV head, not a boolean \(got true\)"),
    ],
)
def test_request_options_are_strict_and_say_what_is_accepted(extra, message):
    with pytest.raises(KVPolicyConfigError, match=message):
        KVPolicyConfig(policy="adasnap", budget=256).check_request_options(extra, 4096)


def test_request_policies_are_none_and_the_servers_family():
    adasnap = KVPolicyConfig(policy="adasnap", budget=256)
    assert adasnap.check_request_options({"kv_policy": "pyramid", "kv_budget": 64, "top_k_other": 1}, 4096) == {
        "kv_policy": "pyramid",
        "kv_budget": 64,
    }
    assert adasnap.check_request_options({"kv_policy": "none"}, 4096) == {"kv_policy": "none"}
    assert KVPolicyConfig(policy="keydiff", budget=256).request_policies() == ["none", "keydiff"]
    assert KVPolicyConfig().request_policies() == ["none"]
