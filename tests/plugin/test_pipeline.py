"""Pipeline parallelism: policies that need what another stage holds are refused at startup, and prefix
caching is off for policies that rewrite blocks (kvpolicy/vllm/startup/parallel.py)."""

import pytest
import torch

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError
from kvpolicy.policies import PromptKV
from kvpolicy.vllm.internals import EngineArgs
from kvpolicy.vllm.startup.parallel import check_pipeline, prepare_pipeline


@pytest.mark.parametrize(
    "policy, message",
    [
        ("omnikv", "filter layers choose the pages the later layers read"),
        ("pod", "layer groups read one layer's attention scores"),
        ("pyramid", "depth in the whole model"),
        ("adapyramid", "depth in the whole model"),
    ],
)
def test_a_policy_that_crosses_stages_is_refused_with_why(policy, message):
    budget = None if policy == "pod" else 128
    with pytest.raises(KVPolicyConfigError, match=message):
        check_pipeline(KVPolicyConfig(policy=policy, budget=budget), 2)
    check_pipeline(KVPolicyConfig(policy=policy, budget=budget), 1)


def kept(policy: str, layer: int, num_layers: int) -> list[list[int]]:
    """The positions ``policy`` keeps of one layer's random 300-token prompt, told it is ``layer`` of ``num_layers``."""
    gen = torch.Generator().manual_seed(0)
    heads, group, length, dim = 2, 2, 300, 16
    prompt = PromptKV(
        torch.randn(heads, length, dim, generator=gen),
        window_queries=torch.randn(heads * group, 32, dim, generator=gen),
        layer=layer,
        num_layers=num_layers,
        queries=torch.randn(heads * group, length, dim, generator=gen),
        values=torch.randn(heads, length, dim, generator=gen),
    )
    return [k.tolist() for k in KVPolicyConfig(policy=policy, budget=128).make_policy().compress(prompt, 128).kept]


@pytest.mark.parametrize("policy", ["adasnap", "snapkv", "keydiff", "h2o", "streaming"])
def test_a_policy_that_stays_in_its_layer_runs_stage_by_stage(policy):
    """Accepted, and a layer keeps the same tokens as layer 17 of the whole model's 30 or as layer 2 of the 15
    its stage holds (as the stage counts it, ``test_a_stage_counts_its_layers_from_its_first``)."""
    check_pipeline(KVPolicyConfig(policy=policy, budget=128), 2)
    assert kept(policy, 17, 30) == kept(policy, 2, 15)


@pytest.mark.parametrize("policy", ["pyramid", "adapyramid"])
def test_what_a_pyramid_keeps_depends_on_the_depth_in_the_whole_model(policy):
    """Why they are refused above, and what the stage-by-stage test would catch: a stage's count differs."""
    assert kept(policy, 17, 30) != kept(policy, 2, 15)


def test_prefix_caching_is_off_under_pipeline_parallelism_unless_asked_for_which_is_refused():
    adasnap = KVPolicyConfig(policy="adasnap", budget=128)
    unset = EngineArgs(model="m", pipeline_parallel_size=2)
    prepare_pipeline(unset, adasnap)
    assert unset.enable_prefix_caching is False
    with pytest.raises(KVPolicyConfigError, match="drop --enable-prefix-caching"):
        prepare_pipeline(EngineArgs(model="m", pipeline_parallel_size=2, enable_prefix_caching=True), adasnap)
    one_stage = EngineArgs(model="m", enable_prefix_caching=True)
    prepare_pipeline(one_stage, adasnap)
    assert one_stage.enable_prefix_caching is True


def test_a_stage_counts_its_layers_from_its_first():
    from kvpolicy.vllm.worker.state import WorkerState

    worker = WorkerState.of(None, None, stage=(1, 15))
    assert worker.layer_index("model.layers.17.self_attn.attn") == 2
    assert worker.pipeline_rank == 1
