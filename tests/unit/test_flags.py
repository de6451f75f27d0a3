"""The options' one source: each option's field gives the CLI flag, its help and the docs' tables."""

import re
from dataclasses import fields

import pytest

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError, policy_flags
from kvpolicy.flags import FLAGS, ROOT, TABLES, table_in
from kvpolicy.policies import POLICIES
from kvpolicy.policies.compose import TokenSelector
from kvpolicy.policies.options import is_option


@pytest.mark.parametrize("name", TABLES)
def test_the_docs_tables_are_the_ones_the_source_writes(name):
    marker, table = TABLES[name]
    assert table_in(ROOT / name, marker) == table(), f"{name} drifted: run `python -m kvpolicy.flags --write`"


def test_every_option_has_help_and_every_flag_reads_the_same_way_in_every_policy():
    for cls in POLICIES.values():
        for f in fields(cls):
            assert is_option(f) and f.metadata["help"], f"{cls.__name__}.{f.name} has no help"
    for flag in FLAGS:
        takers = [policy_flags(name)[flag.name] for name in POLICIES if flag.name in policy_flags(name)]
        assert len({(f.metadata["check"], f.metadata["strict"], str(f.type)) for f in takers}) <= 1, flag.name
        assert flag.help and flag.kind


def test_the_flags_are_todays():
    """Users' commands keep working: the same flag names as before the options moved into the policies."""
    assert [flag.name for flag in FLAGS] == [
        "policy",
        "budget",
        "ratio",
        "decode_buffer",
        "window",
        "pool_kernel",
        "pool_shift",
        "group_scores",
        "alpha",
        "mix",
        "combine",
        "pool_heavy",
        "importance_weight",
        "duplicate_similarity",
        "sink_tokens",
        "recent_fraction",
        "merge",
        "filter_layers",
        "dense_layers",
        "recent_tokens",
        "pod_tau",
        "pod_groups",
        "pod_delta",
        "page_pool",
        "offload",
        "reserve_growth",
        "tp_allocation",
    ]


def test_a_flag_names_the_policies_that_take_it_and_their_defaults():
    help_of = {flag.name: flag.help for flag in FLAGS}
    assert help_of["pool_kernel"].startswith("snapkv, adasnap, pyramid, adapyramid, adamix, adaheavy, rkv: ")
    assert "(default 7; adamix, adaheavy 15)" in help_of["pool_kernel"]
    assert "streaming, d2o: attention-sink tokens always kept (default 4). pod: " in help_of["sink_tokens"]


def test_the_config_nests_the_policys_options_and_drops_what_it_does_not_take():
    config = KVPolicyConfig(policy="adamix", budget=128, window=16, alpha=0.2, sink_tokens=8)
    assert dict(config.options) == {"window": 16, "alpha": 0.2}
    assert config.make_policy().pool_kernel == 15 and config.make_policy().window == 16
    assert KVPolicyConfig.from_dict(config.to_dict()) == config
    pyramid = config.for_policy("pyramid")
    assert dict(pyramid.options) == {"window": 16} and pyramid.make_policy().pool_kernel == 7
    with pytest.raises(KVPolicyConfigError, match="--kv-policy pyramid has no option 'alpha'"):
        KVPolicyConfig(policy="pyramid", budget=128, options={"alpha": 0.2})


def test_a_new_snapkv_family_policy_is_one_compose_line():
    from kvpolicy.policies.adamix import MixedScores
    from kvpolicy.policies.compose import compose
    from kvpolicy.policies.snapkv import AdaKV, Pyramid

    policy = compose(
        "adamixpyramid",
        MixedScores(pool_kernel=15),
        layers=Pyramid(),
        heads=AdaKV(),
        class_name="AdaMixPyramid",
        module=__name__,
        doc="Ada-Mix's scores over PyramidKV's layer capacities.",
    )
    assert issubclass(policy, TokenSelector) and policy.family() == POLICIES["snapkv"].family()
    assert [f.name for f in fields(policy)] == [
        "window",
        "pool_kernel",
        "pool_shift",
        "group_scores",
        "mix",
        "combine",
        "beta",
        "alpha",
    ]


def test_kvpolicy_reads_no_environment_variable_the_operations_doc_does_not_list():
    """Operators set options; the few environment variables kvpolicy's code reads are listed in
    docs/operations.md. Test-only switches live in the tests, not in the package."""
    read = set()
    for path in (ROOT / "kvpolicy").rglob("*.py"):
        read |= set(re.findall(r"[\"'](KVPOLICY_[A-Z0-9_]+)[\"']", path.read_text()))
    section = (ROOT / "docs" / "operations.md").read_text().split("## Environment variables")[1].split("\n## ")[0]
    listed = set(re.findall(r"^\| `(KVPOLICY_[A-Z0-9_]+)` \|", section, re.M))
    assert read == listed == {"KVPOLICY_CACHE", "KVPOLICY_DIAGNOSE"}
