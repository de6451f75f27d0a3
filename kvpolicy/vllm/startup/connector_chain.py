"""kvpolicy's connector beside the KV connectors a deployment already names.

vLLM has one KV-connector slot, which kvpolicy's channel takes; another connector (``--kv-offloading-size``
included) joins through vLLM's ``MultiConnector``, kvpolicy's first, each child with its own metadata, reports
and stats. Beside a policy that rewrites blocks, every vLLM 0.32 connector that saves KV would copy pages under
the hashes of the tokens they replaced, so each is refused with its reason except vLLM's offloading connector,
which gets kvpolicy's own spec (``scheduler/prefix_offload.py``); policies that leave blocks as vLLM wrote them
run beside any. Which connector saves when, and why: docs/architecture.md#beside-other-kv-connectors.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError
from kvpolicy.vllm.internals import KVTransferConfig
from kvpolicy.vllm.scheduler.prefix_offload import SPEC_MODULE, SPEC_NAME

MULTI_CONNECTOR = "MultiConnector"

#: vLLM's connector whose offloading spec kvpolicy replaces with its own (``prefix_offload.py``)
OFFLOADING = "OffloadingConnector"
#: the spec vLLM's offloading connector uses unless told otherwise, and which kvpolicy's extends
VLLM_OFFLOADING_SPEC = "CPUOffloadingSpec"

#: vLLM's connector that copies the device's KV blocks to host memory with CUDA streams
#: (``SimpleCPUOffloadWorker`` makes ``torch.cuda.Stream``s): CUDA and XPU only.
DEVICE_ONLY_OFFLOADING = "SimpleCPUOffloadConnector"

#: connector -> when it copies blocks out, after kvpolicy may have packed pages into them
SAVES_AFTER_PACKING = {
    "SimpleCPUOffloadConnector": "it stores blocks after the forward that packed the prompt's pages",
    "LMCacheConnectorV1": "it saves a prompt's KV at the end of the forward (or layer by layer), after packing",
    "LMCacheMPConnector": "it saves a prompt's KV at the end of the forward (or layer by layer), after packing",
    "ExampleConnector": "it saves a prompt's blocks layer by layer in the forward that reads it and packs them",
}

#: ``kv_role`` of prefill/decode disaggregation (NIXL, Mooncake, P2P NCCL, ...)
DISAGGREGATED_ROLES = frozenset({"kv_producer", "kv_consumer"})


def _as_config(value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if isinstance(value, str):
        import json

        value = json.loads(value)
    return KVTransferConfig(**value)


def _child(config: KVTransferConfig) -> dict[str, Any]:
    """A connector's own settings, as ``MultiConnector`` takes them (``kv_connector_extra_config.connectors``)."""
    defaults = KVTransferConfig()
    return {
        f.name: getattr(config, f.name)
        for f in fields(KVTransferConfig)
        if f.name != "engine_id" and getattr(config, f.name) != getattr(defaults, f.name)
    }


def offloading_child(size_gib: float, backend: str, simple: bool) -> dict[str, Any]:
    """The connector vLLM makes of ``--kv-offloading-size`` (``VllmConfig._post_init_kv_transfer_config``)."""
    if backend == "lmcache":
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}
    return {
        "kv_connector": "SimpleCPUOffloadConnector" if simple else "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": size_gib * (1 << 30)},
    }


def refusal(child: dict[str, Any], config: KVPolicyConfig, on_cpu: bool) -> str | None:
    """Why ``child`` cannot run beside ``--kv-policy``, or None when it can."""
    name = child.get("kv_connector") or "?"
    if on_cpu and name == DEVICE_ONLY_OFFLOADING:
        return (
            f"vLLM's {name} copies KV blocks from accelerator to host memory with CUDA streams and runs on CUDA "
            "and XPU only; use OffloadingConnector (or --kv-offloading-size without VLLM_USE_SIMPLE_KV_OFFLOAD)"
        )
    if name == OFFLOADING:
        spec = _offloading_spec(child)
        if spec in (VLLM_OFFLOADING_SPEC, SPEC_NAME) or not (config.rewrites_blocks or on_cpu):
            return None
        return (
            f"{name} with spec_name {spec}: kvpolicy runs this connector with its own extension of "
            f"{VLLM_OFFLOADING_SPEC}, which stores only blocks that hold their tokens and copies on vLLM's CPU "
            "platform too; drop spec_name"
        )
    if not config.rewrites_blocks:
        return None
    if child.get("kv_role") in DISAGGREGATED_ROLES:
        return (
            f"prefill/decode disaggregation ({name}, {child['kv_role']}) moves a request's blocks between "
            f"instances, and --kv-policy {config.policy} packs pages into them that only this instance's "
            "workers can read"
        )
    why = SAVES_AFTER_PACKING.get(name, "it may copy a request's blocks after its pages were packed into them")
    return (
        f"{name} saves KV by token hashes, and --kv-policy {config.policy} packs a prompt's kept pages into its "
        f"blocks: {why}, so a later prompt would be served pages as tokens"
    )


def _offloading_spec(child: dict[str, Any]) -> str:
    return child.get("kv_connector_extra_config", {}).get("spec_name", VLLM_OFFLOADING_SPEC)


def with_kvpolicy_spec(child: dict[str, Any]) -> dict[str, Any]:
    """vLLM's offloading connector on vLLM's own spec (or kvpolicy's, by name), given kvpolicy's
    (``prefix_offload.py``); others unchanged."""
    if child.get("kv_connector") != OFFLOADING or _offloading_spec(child) not in (VLLM_OFFLOADING_SPEC, SPEC_NAME):
        return child
    extra = {**child.get("kv_connector_extra_config", {}), "spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE}
    return {**child, "kv_connector_extra_config": extra}


def offloads_prefix(transfer: KVTransferConfig) -> bool:
    """Whether ``transfer`` (as ``compose`` made it) runs vLLM's offloading connector."""
    children = transfer.kv_connector_extra_config.get("connectors", [])
    return any(child.get("kv_connector") == OFFLOADING for child in children)


def compose(
    given: KVTransferConfig | dict | str | None,
    own: dict[str, Any],
    config: KVPolicyConfig,
    on_cpu: bool,
    offloading: dict[str, Any] | None = None,
) -> KVTransferConfig:
    """kvpolicy's connector ``own`` alone, or first in a ``MultiConnector`` with the connectors ``given``
    (one, or a ``MultiConnector``'s) and ``offloading``; a connector that cannot run beside the policy
    is refused with the reason."""
    given = _as_config(given)
    if given is None:
        others, base = [], KVTransferConfig(kv_role="kv_both")
    elif given.kv_connector == MULTI_CONNECTOR:
        others, base = list(given.kv_connector_extra_config.get("connectors", [])), given
    else:
        others, base = [_child(given)], KVTransferConfig(kv_role="kv_both", engine_id=given.engine_id)
    if offloading is not None:
        others.append(offloading)
    for child in others:
        if child.get("kv_connector") == own["kv_connector"]:
            raise KVPolicyConfigError("--kv-policy installs its own KV connector; drop it from --kv-transfer-config")
        why = refusal(child, config, on_cpu)
        if why is not None:
            raise KVPolicyConfigError(
                f"--kv-policy {config.policy} cannot run beside {child.get('kv_connector')}: {why}"
            )
    if not others:
        return KVTransferConfig(**own)
    extra = {**base.kv_connector_extra_config, "connectors": [own, *map(with_kvpolicy_spec, others)]}
    return KVTransferConfig(
        kv_connector=MULTI_CONNECTOR,
        kv_role=base.kv_role or "kv_both",
        engine_id=base.engine_id,
        kv_connector_extra_config=extra,
    )
