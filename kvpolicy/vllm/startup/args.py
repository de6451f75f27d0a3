"""The ``--kv-*`` options in every entry point: ``vllm serve``, ``EngineArgs`` and ``LLM(...)``.

Values travel to the engine core and workers inside ``additional_config`` (the
only free-form field vLLM copies to every process); the connector and worker
that implement the policy are set here, before vLLM builds its config, and
everything that can be checked is checked before the model loads.
"""

from __future__ import annotations

import argparse
import os

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError, check_flag
from kvpolicy.flags import FLAGS
from kvpolicy.policies import POLICIES, ModelShape
from kvpolicy.vllm.internals import (
    CPU_RESERVED_CORES_ENV,
    KV_CACHE_LAYOUT_ENV,
    MODEL_RUNNER_V2_ENV,
    PAGE_SPACE_LAYOUTS,
    AttentionBackendEnum,
    EngineArgs,
    InputProcessor,
    SamplingParams,
    VllmConfig,
    VLLMValidationError,
    current_platform,
    envs,
)
from kvpolicy.vllm.patches import EngineArgsHooks, replace_engine_args
from kvpolicy.vllm.startup.connector_chain import compose, offloading_child, offloads_prefix
from kvpolicy.vllm.startup.parallel import check_pipeline, prepare_pipeline

ARG_GROUP = "KVPolicy"
CONNECTOR_NAME = "KVPolicyConnector"
CONNECTOR_MODULE = "kvpolicy.vllm.scheduler.connector"
CPU_WORKER_CLS = "kvpolicy.vllm.worker.hook.KVPolicyCPUWorker"
GPU_WORKER_CLS = "kvpolicy.vllm.worker.hook.KVPolicyGPUWorker"
#: Head sizes vLLM's CPU attention kernels serve.
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: kvpolicy's Triton kernels hold a head in one tile: head sizes up to this (CUDA).
TRITON_MAX_HEAD_SIZE = 256

#: kwarg / CLI dest -> flag name
OPTION_FIELDS = {f"kv_{flag.name}": flag.name for flag in FLAGS}


def _option_type(name: str, convert):
    """argparse ``type=``: convert, then judge the single value as its option's field does."""

    def parse(text: str):
        value = convert(text)
        try:
            check_flag(name, value)
        except KVPolicyConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    parse.__name__ = convert.__name__
    return parse


def _boolean(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices such as 2,8,18; got {text!r}"
        ) from None


_CONVERTERS = {"int": int, "float": float, "str": str, "bool": _boolean, "layers": _layer_list}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--kv-*`` flags, as ``kvpolicy.flags`` reads them from the options' fields."""
    group = parser.add_argument_group(
        ARG_GROUP, description="KV-cache compression inside vLLM's paged attention (kvpolicy)."
    )
    for flag in FLAGS:
        group.add_argument(
            flag.option,
            type=_option_type(flag.name, _CONVERTERS[flag.kind]),
            default=None,
            metavar=flag.metavar,
            help=flag.help.replace("%", "%%"),
        )


def config_from_options(options: dict) -> KVPolicyConfig | None:
    """A config from ``kv_*`` option values, or None when no policy was asked for."""
    given = {OPTION_FIELDS[k]: v for k, v in options.items() if k in OPTION_FIELDS and v is not None}
    if "policy" not in given:
        stray = sorted(flag.option for flag in FLAGS if flag.name in given and given[flag.name] != flag.default)
        if stray:
            raise KVPolicyConfigError(f"{', '.join(stray)} need --kv-policy")
        return None
    return KVPolicyConfig(**given)


def _store(engine_args: EngineArgs, config: KVPolicyConfig | None) -> None:
    if config is None:
        return
    engine_args.additional_config = dict(engine_args.additional_config or {})
    engine_args.additional_config[KVPolicyConfig.ADDITIONAL_CONFIG_KEY] = config.to_dict()


def _prepare_engine_args(engine_args: EngineArgs, config: KVPolicyConfig) -> None:
    """Point vLLM at our connector and worker; refuse combinations we cannot serve."""
    worker_cls = _platform_worker(engine_args, config)
    prepare_pipeline(engine_args, config)
    engine_args.kv_transfer_config = compose(
        engine_args.kv_transfer_config,
        {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both", "kv_connector_module_path": CONNECTOR_MODULE},
        config,
        on_cpu=current_platform.is_cpu(),
        offloading=_take_offloading(engine_args),
    )
    offloading = offloads_prefix(engine_args.kv_transfer_config)
    if config.rewrites_blocks and offloading and engine_args.pipeline_parallel_size > 1:
        raise KVPolicyConfigError(
            f"--kv-policy {config.policy} cannot run beside OffloadingConnector with --pipeline-parallel-size "
            f"{engine_args.pipeline_parallel_size}: vLLM schedules a stage's next batch before it reads which "
            "requests the last step relocated, so the connector cannot tell which copies came after; drop one"
        )
    # vLLM's asynchronous scheduler (its CUDA default) schedules a step before it reads the step
    # before's report. With prefix caching the connector takes the blocks a step may rewrite out of
    # the cache when it schedules the step (rewrite_bounds.py); the offloading connector, though, would not
    # know which of its copies came after a relocation (rewrite_history.py), so beside it the synchronous
    # scheduler stays.
    if config.rewrites_blocks and offloading:
        if engine_args.async_scheduling:
            raise KVPolicyConfigError(
                f"--kv-policy {config.policy} with OffloadingConnector needs vLLM's synchronous scheduler; "
                "drop --async-scheduling"
            )
        engine_args.async_scheduling = False
    if config.rewrites_blocks:
        if engine_args.speculative_config:
            raise KVPolicyConfigError(f"--kv-policy {config.policy} does not support speculative decoding")
        if POLICIES[config.policy].schedule.per_chunk:
            engine_args.scheduler_reserve_full_isl = (
                False  # admitted by what it holds (kvpolicy/vllm/startup/admission.py)
            )
    if config.changes_attention and engine_args.kv_cache_dtype not in ("auto", None):
        raise KVPolicyConfigError(f"--kv-policy {config.policy} needs an unquantized KV cache; drop --kv-cache-dtype")
    # Our connector moves no KV between hosts: keep vLLM's stock core reservation
    # (one per local rank) instead of the extra core it reserves for any connector.
    ranks = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    os.environ.setdefault(CPU_RESERVED_CORES_ENV, str(ranks))
    if engine_args.worker_cls not in ("auto", worker_cls):
        raise KVPolicyConfigError("--kv-policy needs its own worker class; drop --worker-cls")
    engine_args.worker_cls = worker_cls


def _take_offloading(engine_args: EngineArgs) -> dict | None:
    """``--kv-offloading-size`` as the connector vLLM would make of it, which would replace kvpolicy's."""
    size, engine_args.kv_offloading_size = engine_args.kv_offloading_size, None
    if size is None:
        return None
    return offloading_child(size, engine_args.kv_offloading_backend, envs.VLLM_USE_SIMPLE_KV_OFFLOAD)


def _platform_worker(engine_args: EngineArgs, config: KVPolicyConfig) -> str:
    """The worker for this platform; on CUDA, kvpolicy's backend wraps vLLM's Triton attention."""
    if current_platform.is_cpu():
        return CPU_WORKER_CLS
    if not current_platform.is_cuda():
        raise KVPolicyConfigError("--kv-policy runs on vLLM's CPU and CUDA platforms only; use --kv-policy none")
    if config.changes_attention:
        chosen = engine_args.attention_backend
        if chosen is not None and chosen != AttentionBackendEnum.TRITON_ATTN:
            raise KVPolicyConfigError(
                f"--kv-policy {config.policy} runs inside vLLM's Triton attention backend on CUDA; "
                f"drop --attention-backend {getattr(chosen, 'name', chosen)} (or set it to TRITON_ATTN)"
            )
        engine_args.attention_backend = AttentionBackendEnum.TRITON_ATTN
    if config.page_pool == "model":
        raise KVPolicyConfigError(
            "--kv-page-pool model (one page pool over every layer's cache) was only run on vLLM's CPU platform; "
            "drop it on CUDA"
        )
    if os.environ.get(MODEL_RUNNER_V2_ENV, "0").lower() not in ("0", "false"):
        raise KVPolicyConfigError(
            f"--kv-policy {config.policy} runs on vLLM's V1 model runner; unset {MODEL_RUNNER_V2_ENV}"
        )
    os.environ[MODEL_RUNNER_V2_ENV] = "0"
    if config.changes_attention:  # one-head page ids FlashAttention 3 reads as they are (no conversion per call)
        _choose_page_space_layout(config)
    return GPU_WORKER_CLS


def _choose_page_space_layout(config: KVPolicyConfig) -> None:
    """Have vLLM lay each layer's cache out as one contiguous [blocks, kv_heads, block_size, 2*head_size]
    slice of its buffer, which the worker's page space addresses as one-head pages (``PageSpace``).

    vLLM's Triton attention and kvpolicy's Triton ops read any strides; left alone, vLLM picks a layout
    whose blocks interleave their heads' tokens."""
    chosen = os.environ.setdefault(KV_CACHE_LAYOUT_ENV, PAGE_SPACE_LAYOUTS[0])
    if chosen not in PAGE_SPACE_LAYOUTS:
        raise KVPolicyConfigError(
            f"--kv-policy {config.policy} needs vLLM's {PAGE_SPACE_LAYOUTS[0]} KV cache layout (each layer's cache "
            f"one contiguous [blocks, heads, block_size, 2*head_size] slice), and {KV_CACHE_LAYOUT_ENV} is {chosen}; "
            f"unset it (kvpolicy then sets {PAGE_SPACE_LAYOUTS[0]})"
        )


def check_model(config: KVPolicyConfig, vllm_config: VllmConfig) -> None:
    """Shapes and features the per-head backend cannot serve, refused before the model loads."""
    model_config = vllm_config.model_config
    config.check_model_len(model_config.max_model_len)
    check_pipeline(config, vllm_config.parallel_config.pipeline_parallel_size)
    if not config.changes_attention:
        return
    head_size = model_config.get_head_size()
    if current_platform.is_cpu() and head_size not in SUPPORTED_HEAD_SIZES:
        raise KVPolicyConfigError(
            f"head size {head_size} of {model_config.model} is not served by the CPU attention "
            f"kernels ({', '.join(map(str, SUPPORTED_HEAD_SIZES))}); use --kv-policy none"
        )
    if current_platform.is_cuda() and head_size > TRITON_MAX_HEAD_SIZE:
        raise KVPolicyConfigError(
            f"head size {head_size} of {model_config.model} is over what kvpolicy's Triton kernels "
            f"hold ({TRITON_MAX_HEAD_SIZE}); use --kv-policy none"
        )
    if model_config.use_mla:
        raise KVPolicyConfigError(f"{model_config.model} uses MLA attention; use --kv-policy none")
    tensor_parallel = vllm_config.parallel_config.tensor_parallel_size
    kv_heads = model_config.get_total_num_kv_heads()
    if kv_heads % tensor_parallel:
        raise KVPolicyConfigError(
            f"--tensor-parallel-size {tensor_parallel} does not split the {kv_heads} KV heads of {model_config.model} "
            f"evenly (vLLM would copy them across ranks); use a size that divides {kv_heads}, or --kv-policy none"
        )
    if getattr(model_config.hf_text_config, "sliding_window", None):
        raise KVPolicyConfigError(
            f"{model_config.model} uses sliding-window attention, which --kv-policy "
            f"{config.policy} does not support yet; use --kv-policy none"
        )
    if not model_config.is_attention_free and model_config.is_hybrid:
        raise KVPolicyConfigError(f"{model_config.model} is a hybrid model; use --kv-policy none")
    model = ModelShape(
        name=model_config.model,
        num_layers=model_config.get_num_layers(vllm_config.parallel_config),
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        tensor_parallel=tensor_parallel,
        max_model_len=model_config.max_model_len,
        ratio=config.ratio,
    )
    try:
        config.make_policy().check_model(model)
    except ValueError as exc:
        raise KVPolicyConfigError(str(exc)) from None


def _prepare(engine_args: EngineArgs) -> KVPolicyConfig | None:
    config = KVPolicyConfig.stored_in(engine_args.additional_config)
    if config is not None:
        _prepare_engine_args(engine_args, config)
    return config


def _check_request(input_processor: InputProcessor, params) -> None:
    """A request's ``vllm_xargs`` ``kv_*`` options, checked against the server's; a policy that changes
    what the cache holds never reads the prefix cache."""
    if not isinstance(params, SamplingParams):
        return
    config = KVPolicyConfig.stored_in(input_processor.vllm_config.additional_config)
    if config is not None and not POLICIES[config.policy].reads_prefix_cache():
        params.skip_reading_prefix_cache = True
    extra = params.extra_args
    if extra and any(key.startswith("kv_") for key in extra):
        try:
            (config or KVPolicyConfig()).check_request_options(extra, input_processor.model_config.max_model_len)
        except KVPolicyConfigError as exc:
            raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None


ENGINE_ARGS_HOOKS = EngineArgsHooks(
    add_arguments=add_arguments,
    store_options=lambda engine_args, options: _store(engine_args, config_from_options(options)),
    prepare=_prepare,
    check_model=check_model,
    check_request=_check_request,
    option_names=frozenset(OPTION_FIELDS),
)


def patch_engine_args() -> None:
    """Teach EngineArgs the kv_* options (``patches.replace_engine_args``). Safe to call any number of times."""
    replace_engine_args(ENGINE_ARGS_HOOKS)
