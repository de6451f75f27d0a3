"""The CPU and CUDA backends are siblings: one step builder, one dispatch mixin, their platform's classes below.

The CUDA backend cannot run here; what can be checked without a GPU is
checked: it imports beside vLLM's Triton backend, keeps its name, mixes in
the same dispatch, reports to vLLM's CUDA-graph resolution that attention
runs outside graphs only while a policy changes attention, and prepares
vLLM's options on CUDA as the engine run on a GPU needed them.
"""

import json
from types import SimpleNamespace

import pytest

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError
from kvpolicy.policies import ModelShape
from kvpolicy.policies.pod import LayerGroups
from kvpolicy.vllm.internals import (
    KV_CACHE_LAYOUT_ENV,
    MODEL_RUNNER_V2_ENV,
    PAGE_SPACE_LAYOUTS,
    AttentionBackendEnum,
    AttentionCGSupport,
    EngineArgs,
)
from kvpolicy.vllm.startup import args
from kvpolicy.vllm.worker import cpu_backend, cuda_backend
from kvpolicy.vllm.worker.attention import KVPolicyAttention
from kvpolicy.vllm.worker.step_builder import KVPolicyMetadataBuilder


@pytest.mark.parametrize(
    "backend, name", [(cpu_backend.KVPolicyCPUBackend, "CPU_ATTN"), (cuda_backend.KVPolicyTritonBackend, "TRITON_ATTN")]
)
def test_each_backend_keeps_its_platform_name_and_mixes_in_the_dispatch(backend, name):
    assert backend.get_name() == name
    impl = backend.get_impl_cls()
    assert impl.__mro__[1] is KVPolicyAttention
    assert impl.__mro__[2] is backend.__mro__[1].get_impl_cls()
    builder = backend.get_builder_cls()
    assert builder.__mro__[1] is KVPolicyMetadataBuilder
    assert builder.__mro__[2] is backend.__mro__[1].get_builder_cls()


def test_cuda_builder_keeps_full_graphs_for_decode_where_the_policy_can_and_none_for_attention_elsewhere():
    builder = cuda_backend.KVPolicyTritonBackend.get_builder_cls()
    stock = builder.__mro__[2].get_cudagraph_support(None, None)
    model = SimpleNamespace(get_num_layers=lambda _: 32, get_num_kv_heads=lambda _: 8, max_model_len=5120)

    def support(policy, max_num_seqs=256):
        extra = (
            {}
            if policy is None
            else {KVPolicyConfig.ADDITIONAL_CONFIG_KEY: KVPolicyConfig(policy=policy, budget=256).to_dict()}
        )
        config = SimpleNamespace(
            additional_config=extra,
            model_config=model,
            parallel_config=None,
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        )
        return builder.get_cudagraph_support(config, SimpleNamespace(block_size=16))

    assert support(None) == support("none") == stock
    assert support("adasnap") == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert support("keydiff") == support("omnikv") == AttentionCGSupport.NEVER, "host work in decode"
    assert support("adasnap", max_num_seqs=4096) == AttentionCGSupport.NEVER, "buffers past 1 GiB"


def test_on_cuda_a_policy_gets_vllms_triton_attention_and_v1_model_runner(on_cuda):
    engine_args = EngineArgs(model="m")
    args._prepare_engine_args(engine_args, KVPolicyConfig(policy="adasnap", budget=128))
    assert engine_args.worker_cls == args.GPU_WORKER_CLS
    assert engine_args.attention_backend == AttentionBackendEnum.TRITON_ATTN
    assert args.os.environ[MODEL_RUNNER_V2_ENV] == "0"


@pytest.mark.parametrize(
    "options, env, message",
    [
        ({"attention_backend": AttentionBackendEnum.FLASH_ATTN}, {}, "drop --attention-backend FLASH_ATTN"),
        ({}, {MODEL_RUNNER_V2_ENV: "1"}, f"unset {MODEL_RUNNER_V2_ENV}"),
    ],
)
def test_on_cuda_what_the_policy_cannot_run_beside_is_refused_with_what_to_change(on_cuda, options, env, message):
    for name, value in env.items():
        on_cuda.setenv(name, value)
    with pytest.raises(KVPolicyConfigError, match=message):
        args._prepare_engine_args(EngineArgs(model="m", **options), KVPolicyConfig(policy="adasnap", budget=128))


def test_on_cuda_pages_stay_in_each_layers_cache(on_cuda):
    with pytest.raises(
        KVPolicyConfigError, match="--kv-page-pool model .* was only run on vLLM's CPU platform; drop it on CUDA"
    ):
        args._prepare_engine_args(
            EngineArgs(model="m"), KVPolicyConfig(policy="pyramid", budget=128, page_pool="model")
        )
    args._prepare_engine_args(EngineArgs(model="m"), KVPolicyConfig(policy="pyramid", budget=128, page_pool="layer"))


@pytest.mark.parametrize(
    "policy, prefix_caching",
    # The blocks a step rewrites leave the prefix cache when it is scheduled (rewrite_bounds.py).
    [("adasnap", False), ("adasnap", None), ("pod", True), ("omnikv", None)],
)
def test_on_cuda_every_policy_keeps_vllms_asynchronous_scheduler_prefix_caching_or_not(on_cuda, policy, prefix_caching):
    engine_args = EngineArgs(model="m", enable_prefix_caching=prefix_caching)
    args._prepare_engine_args(engine_args, KVPolicyConfig(policy=policy, budget=128))
    assert engine_args.async_scheduling is None


def test_on_cuda_none_keeps_vllms_scheduler(on_cuda):
    engine_args = EngineArgs(model="m")
    args._prepare_engine_args(engine_args, KVPolicyConfig(policy="none"))
    assert engine_args.async_scheduling is None


@pytest.mark.parametrize("given, kept", [(None, "LBHNC"), ("LBHNC", "LBHNC"), ("HND", "HND")])
def test_on_cuda_pod_is_accepted_and_asks_vllm_for_the_layout_its_page_space_addresses(on_cuda, given, kept):
    if given is not None:
        on_cuda.setenv(KV_CACHE_LAYOUT_ENV, given)
    engine_args = EngineArgs(model="m")
    args._prepare_engine_args(engine_args, KVPolicyConfig(policy="pod"))
    assert engine_args.worker_cls == args.GPU_WORKER_CLS
    assert args.os.environ[KV_CACHE_LAYOUT_ENV] == kept


def test_on_cuda_pod_is_refused_under_a_layout_whose_blocks_interleave_their_heads(on_cuda):
    on_cuda.setenv(KV_CACHE_LAYOUT_ENV, "LBNHC")
    with pytest.raises(KVPolicyConfigError, match=f"{KV_CACHE_LAYOUT_ENV} is LBNHC; unset it"):
        args._prepare_engine_args(EngineArgs(model="m"), KVPolicyConfig(policy="pod"))


def test_on_cuda_none_leaves_vllms_layout_alone(on_cuda):
    args._prepare_engine_args(EngineArgs(model="m"), KVPolicyConfig(policy="none"))
    assert KV_CACHE_LAYOUT_ENV not in args.os.environ


@pytest.mark.parametrize("policy", ["adasnap", "omnikv"])
def test_on_cuda_every_policy_that_changes_attention_takes_the_page_space_layout(on_cuda, policy):
    """Its one-head page ids are then FlashAttention 3's page ids as they are (no conversion per call)."""
    args._prepare_engine_args(EngineArgs(model="m"), KVPolicyConfig(policy=policy, budget=128))
    assert args.os.environ[KV_CACHE_LAYOUT_ENV] == PAGE_SPACE_LAYOUTS[0]


def test_pod_checks_its_grouping_and_still_refuses_tensor_parallelism():
    pod = KVPolicyConfig(policy="pod").make_policy()
    groups = pod.layer_groups()
    pod.check_model(ModelShape("m", groups.num_layers, groups.num_heads))
    with pytest.raises(ValueError, match="does not support tensor parallelism yet"):
        pod.check_model(ModelShape("m", groups.num_layers, groups.num_heads, tensor_parallel=2))
    with pytest.raises(ValueError, match=f"is for {groups.num_layers} layers x {groups.num_heads} KV heads"):
        pod.check_model(ModelShape("m", groups.num_layers + 1, groups.num_heads))


def test_a_pod_delta_without_a_similarity_to_regroup_is_refused_at_startup(tmp_path):
    blocks_only = tmp_path / "blocks.json"
    blocks_only.write_text(json.dumps({"blocks": LayerGroups.single_layers(30, 3).blocks}))
    config = KVPolicyConfig(policy="pod", pod_groups=str(blocks_only), pod_delta=0.5)
    with pytest.raises(ValueError, match="holds no similarity to regroup at delta 0.5"):
        config.make_policy().check_model(ModelShape("m", 30, 3))


def test_on_cuda_omnikvs_host_offload_is_accepted_in_the_layout_its_page_space_addresses(on_cuda):
    engine_args = EngineArgs(model="m")
    args._prepare_engine_args(engine_args, KVPolicyConfig(policy="omnikv", budget=512, offload=1.0))
    assert engine_args.worker_cls == args.GPU_WORKER_CLS
    assert args.os.environ[KV_CACHE_LAYOUT_ENV] == "LBHNC"
