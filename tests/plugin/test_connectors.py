"""kvpolicy's connector beside the connectors a deployment names: one vLLM MultiConnector, kvpolicy's first,
vLLM's offloading connector with kvpolicy's offloading spec, or a refusal at startup that says why
(kvpolicy/vllm/startup/connector_chain.py)."""

import pytest

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError
from kvpolicy.vllm.internals import EngineArgs, KVTransferConfig
from kvpolicy.vllm.messages import KVPolicyConnectorMetadata, own_metadata
from kvpolicy.vllm.scheduler.prefix_offload import SPEC_MODULE, SPEC_NAME
from kvpolicy.vllm.startup import args
from kvpolicy.vllm.startup.connector_chain import MULTI_CONNECTOR, compose

OWN = {"kv_connector": args.CONNECTOR_NAME, "kv_role": "kv_both", "kv_connector_module_path": args.CONNECTOR_MODULE}
EXAMPLE = {
    "kv_connector": "ExampleConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/s"},
}
OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"x": 1}}
OMNIKV = KVPolicyConfig(policy="omnikv", budget=128)
ADASNAP = KVPolicyConfig(policy="adasnap", budget=128)


def children(transfer: KVTransferConfig) -> list[dict]:
    assert transfer.kv_connector == MULTI_CONNECTOR
    return transfer.kv_connector_extra_config["connectors"]


def test_alone_kvpolicy_takes_the_slot():
    transfer = compose(None, OWN, ADASNAP, on_cpu=True)
    assert (transfer.kv_connector, transfer.kv_connector_module_path) == (args.CONNECTOR_NAME, args.CONNECTOR_MODULE)


def test_a_named_connector_joins_kvpolicys_in_a_multiconnector_with_its_own_settings_and_engine_id():
    given = KVTransferConfig(**EXAMPLE, engine_id="e1")
    transfer = compose(given, OWN, OMNIKV, on_cpu=True)
    assert children(transfer) == [OWN, EXAMPLE]
    assert transfer.engine_id == "e1"


def test_a_multiconnector_gets_kvpolicys_connector_first_and_keeps_its_own_children():
    given = {
        "kv_connector": MULTI_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [EXAMPLE]},
    }
    assert children(compose(given, OWN, OMNIKV, on_cpu=True)) == [OWN, EXAMPLE]


@pytest.mark.parametrize(
    "child, config, on_cpu, message",
    [
        ({"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"}, OMNIKV, True, "CUDA and XPU only"),
        (
            {**OFFLOADING, "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec"}},
            ADASNAP,
            False,
            "drop spec_name",
        ),
        ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, ADASNAP, False, "end of the forward"),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, ADASNAP, False, "prefill/decode"),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}, ADASNAP, False, "prefill/decode"),
        (EXAMPLE, ADASNAP, True, "served pages as tokens"),
        (OWN, OMNIKV, True, "installs its own KV connector"),
    ],
)
def test_a_connector_that_cannot_run_beside_the_policy_is_refused_with_why(child, config, on_cpu, message):
    with pytest.raises(KVPolicyConfigError, match=message):
        compose(KVTransferConfig(**child), OWN, config, on_cpu=on_cpu)


@pytest.mark.parametrize("config", [OMNIKV, ADASNAP], ids=["omnikv", "adasnap"])
@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu", "cuda"])
def test_vllms_offloading_connector_runs_with_kvpolicys_offloading_spec_and_its_own_settings(config, on_cpu):
    offloading = children(compose(KVTransferConfig(**OFFLOADING), OWN, config, on_cpu=on_cpu))[1]
    assert offloading["kv_connector_extra_config"] == {"x": 1, "spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE}


def test_another_offloading_spec_runs_unchanged_beside_a_policy_that_leaves_blocks_alone_on_cuda():
    tiering = {**OFFLOADING, "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec"}}
    assert children(compose(KVTransferConfig(**tiering), OWN, OMNIKV, on_cpu=False))[1] == tiering
    with pytest.raises(KVPolicyConfigError, match="drop spec_name"):
        compose(KVTransferConfig(**tiering), OWN, OMNIKV, on_cpu=True)


@pytest.mark.parametrize("name", ["LMCacheConnectorV1", "NixlConnector"])
def test_a_policy_that_leaves_blocks_as_vllm_wrote_them_runs_beside_any_connector_that_runs_here(name):
    assert children(compose(KVTransferConfig(kv_connector=name, kv_role="kv_both"), OWN, OMNIKV, on_cpu=False))[1] == {
        "kv_connector": name,
        "kv_role": "kv_both",
    }


def test_kv_offloading_size_becomes_a_child_instead_of_replacing_kvpolicys_connector():
    engine_args = EngineArgs(model="m", kv_offloading_size=2.0)
    args._prepare_engine_args(engine_args, ADASNAP)
    assert engine_args.kv_offloading_size is None
    offloading = children(engine_args.kv_transfer_config)[1]
    assert offloading["kv_connector"] == "OffloadingConnector"
    assert offloading["kv_connector_extra_config"]["spec_name"] == SPEC_NAME
    # Which stores came after a relocation is known only if each step's report is read before the next is scheduled.
    assert engine_args.async_scheduling is False


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            {"async_scheduling": True, "enable_prefix_caching": False},
            "with OffloadingConnector needs vLLM's synchronous scheduler; drop --async-scheduling$",
        ),
        ({"pipeline_parallel_size": 2}, "cannot run beside OffloadingConnector with --pipeline-parallel-size 2"),
    ],
    ids=["async", "pipeline"],
)
def test_the_offloading_connector_beside_a_rewriting_policy_needs_each_steps_report_before_the_next(flags, message):
    engine_args = EngineArgs(model="m", kv_transfer_config=KVTransferConfig(**OFFLOADING), **flags)
    with pytest.raises(KVPolicyConfigError, match=message):
        args._prepare_engine_args(engine_args, ADASNAP)


def test_the_engine_args_path_composes_a_named_connector():
    engine_args = EngineArgs(model="m", kv_transfer_config=KVTransferConfig(**EXAMPLE))
    args._prepare_engine_args(engine_args, OMNIKV)
    assert [c["kv_connector"] for c in children(engine_args.kv_transfer_config)] == [
        args.CONNECTOR_NAME,
        "ExampleConnector",
    ]


def test_the_worker_finds_kvpolicys_metadata_alone_or_inside_a_multiconnectors():
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorMetadata

    own = KVPolicyConnectorMetadata({"r": ([0], [1])})
    assert own_metadata(own) is own
    assert own_metadata(MultiKVConnectorMetadata(metadata=(own, None))) is own
    assert own_metadata(None) is None
