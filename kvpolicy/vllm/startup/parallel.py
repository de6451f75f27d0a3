"""What kvpolicy can serve under vLLM's pipeline parallelism, judged before the model loads.

A stage holds only its own layers' cache and each worker compresses what it holds, so a policy whose choice in a
layer depends on nothing outside it runs stage by stage; one that carries something between layers or sizes a
layer by its depth in the whole model is refused (the hidden states cross stages alone). vLLM schedules a
stage's next batch before it reads a step's report, so prefix caching is off unless asked for, and refused when
asked for. Details and measurements: docs/architecture.md#pipeline-parallelism.
"""

from __future__ import annotations

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError
from kvpolicy.policies import POLICIES
from kvpolicy.policies.compose import TokenSelector
from kvpolicy.policies.snapkv import Pyramid


def check_pipeline(config: KVPolicyConfig, pipeline_parallel_size: int) -> None:
    """Refuse a policy that needs what another stage holds."""
    if pipeline_parallel_size <= 1:
        return
    flag = f"--pipeline-parallel-size {pipeline_parallel_size}"
    why = POLICIES[config.policy].mode.traits.crosses_stages
    if why is not None:
        raise KVPolicyConfigError(f"--kv-policy {config.policy} cannot run with {flag}: {why}; drop one of them")
    policy = config.make_policy()
    if isinstance(policy, TokenSelector) and isinstance(policy.layers, Pyramid):
        raise KVPolicyConfigError(
            f"--kv-policy {config.policy} cannot run with {flag}: it sizes each layer's budget by the layer's "
            "depth in the whole model, and a stage sees only its own layers; use adasnap or snapkv"
        )


def prepare_pipeline(engine_args, config: KVPolicyConfig) -> None:
    """Prefix caching off under pipeline parallelism for policies that rewrite blocks (see above)."""
    if engine_args.pipeline_parallel_size <= 1 or not config.rewrites_blocks:
        return
    if engine_args.enable_prefix_caching:
        raise KVPolicyConfigError(
            f"--kv-policy {config.policy} with prefix caching cannot run with --pipeline-parallel-size "
            f"{engine_args.pipeline_parallel_size}: vLLM schedules a stage's next batch before it reads the "
            "step that relocated blocks, which may still be in the prefix cache; drop --enable-prefix-caching"
        )
    engine_args.enable_prefix_caching = False
