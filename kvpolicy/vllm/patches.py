"""Every vLLM function kvpolicy replaces, in one place (checked against vLLM 0.32.0).

Each replacement wraps vLLM's own function and calls it; what kvpolicy adds is passed in by the
caller (start-up, the scheduler's connector, the worker hook), so this module knows vLLM and nothing
of policies. An upgrade of vLLM reads this table first.

| vLLM function (0.32.0) | replaced by | why |
|---|---|---|
| ``EngineArgs.add_cli_args`` (engine/arg_utils.py) | ``replace_engine_args`` | adds the ``--kv-*`` group to every entry point's parser |
| ``EngineArgs.from_cli_args`` | ``replace_engine_args`` | copies only dataclass fields: kvpolicy folds its options into ``additional_config``, the one field every process receives |
| ``EngineArgs.create_engine_config`` | ``replace_engine_args`` | names kvpolicy's connector and worker before vLLM builds its config, then refuses a model it cannot serve |
| ``EngineArgs.__init__``, ``AsyncEngineArgs.__init__`` | ``replace_engine_args`` | ``LLM(kv_policy=...)`` forwards keyword arguments to ``EngineArgs`` |
| ``InputProcessor._validate_params`` (v1/engine/input_processor.py) | ``replace_engine_args`` | checks per-request ``vllm_xargs`` ``kv_*`` options and keeps a compressing request from reading the prefix cache |
| ``kv_cache_utils.<KV_MEMORY_NEEDED_FUNCTIONS>`` (v1/core/kv_cache_utils.py) | ``judge_kv_memory_by`` | the start-up check that one request of ``max_model_len`` fits the pool is judged on the policy's bound |
| ``KVCacheManager.allocate_slots``, per instance (v1/core/kv_cache_manager.py) | ``reserve_for_admissions`` | a new request is admitted only if the blocks that compressed requests will grow into stay free |
| ``CudagraphDispatcher.dispatch``, per instance (v1/cudagraph_dispatcher.py) | ``forbid_full_graphs_while`` | no full CUDA graph for a step that reads a prompt (it has host work after attention) |
| the ``vllm_xargs`` field type of ``internals.XARGS_REQUEST_MODELS`` (entrypoints/openai/*/protocol.py) | ``keep_request_booleans`` | typed as strings, ints, floats or lists of them, pydantic reads JSON's ``true`` as 1: ``bool`` first keeps it a boolean, which the ``kv_*`` checks refuse by name |
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpolicy.vllm.internals import (
    KV_MEMORY_NEEDED_FUNCTIONS,
    AsyncEngineArgs,
    CUDAGraphMode,
    EngineArgs,
    InputProcessor,
    kv_cache_utils,
)

_REPLACED = "_kvpolicy_replaced"


@dataclass(frozen=True)
class EngineArgsHooks:
    """What start-up adds to vLLM's engine arguments (``startup/args.py``)."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    #: ``kv_*`` option values -> stored into the engine args (``additional_config``).
    store_options: Callable[[EngineArgs, dict], None]
    #: (engine args) -> the config kvpolicy serves, or None; called before vLLM builds its config.
    prepare: Callable[[EngineArgs], object]
    #: (stored config, vLLM's config): refuses what cannot be served.
    check_model: Callable[[object, object], None]
    #: (input processor, params): per-request options, after vLLM's own validation.
    check_request: Callable[[object, object], None]
    #: names of ``EngineArgs.__init__`` keyword arguments kvpolicy takes.
    option_names: frozenset[str]


def replace_engine_args(hooks: EngineArgsHooks) -> None:
    """Teach ``EngineArgs`` (and so ``vllm serve``, ``LLM`` and ``vllm bench``) the ``--kv-*`` options.
    Safe to call any number of times."""
    if getattr(EngineArgs, _REPLACED, False):
        return
    original_add = EngineArgs.add_cli_args

    @functools.wraps(original_add)
    def add_cli_args(parser, *args, **kwargs):
        parser = original_add(parser, *args, **kwargs)
        hooks.add_arguments(parser)
        return parser

    original_from_cli = EngineArgs.from_cli_args.__func__

    def from_cli_args(cls, args: argparse.Namespace):
        engine_args = original_from_cli(cls, args)
        hooks.store_options(engine_args, vars(args))
        # vLLM's extra API servers (--api-server-count, data parallelism) parse this namespace again
        # before they load plugins: ``additional_config`` is a field they keep.
        args.additional_config = engine_args.additional_config
        return engine_args

    original_create = EngineArgs.create_engine_config

    @functools.wraps(original_create)
    def create_engine_config(self, *args, **kwargs):
        config = hooks.prepare(self)
        vllm_config = original_create(self, *args, **kwargs)
        if config is not None:
            hooks.check_model(config, vllm_config)
        return vllm_config

    original_validate = InputProcessor._validate_params

    @functools.wraps(original_validate)
    def _validate_params(self, params, *args, **kwargs):
        result = original_validate(self, params, *args, **kwargs)
        hooks.check_request(self, params)
        return result

    def accept_options(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            options = {k: kwargs.pop(k) for k in list(kwargs) if k in hooks.option_names}
            init(self, *args, **kwargs)
            hooks.store_options(self, options)

        return __init__

    InputProcessor._validate_params = _validate_params
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
    for cls in (EngineArgs, AsyncEngineArgs):
        cls.__init__ = accept_options(cls.__init__)
    setattr(EngineArgs, _REPLACED, True)


#: ``vllm_xargs``' values with ``bool`` first: pydantic keeps JSON's true a boolean, not the int 1.
_XARGS_TYPE = dict[str, bool | str | int | float | list[bool | str | int | float]] | None


def keep_request_booleans(models: tuple[tuple[str, str], ...]) -> None:
    """Retype the ``vllm_xargs`` field of the request models ``(module, class)`` so a boolean stays one.
    Before the API server declares its routes (plugins load first). Safe to call any number of times."""
    for module, name in models:
        model = getattr(importlib.import_module(module), name)
        field = model.model_fields["vllm_xargs"]
        if field.annotation != _XARGS_TYPE:
            field.annotation = _XARGS_TYPE
            model.model_rebuild(force=True)


def judged_on_bound(needed, request_bound: Callable[[object], int | None]):
    """``needed(vllm_config, ...)`` run with ``max_model_len`` set to ``request_bound(vllm_config)`` when
    that is smaller, and restored after."""

    @functools.wraps(needed)
    def wrapper(vllm_config, *args, **kwargs):
        bound = request_bound(vllm_config)
        model_config = vllm_config.model_config
        if bound is None or bound >= model_config.max_model_len:
            return needed(vllm_config, *args, **kwargs)
        max_model_len = model_config.max_model_len
        model_config.max_model_len = bound
        try:
            return needed(vllm_config, *args, **kwargs)
        finally:
            model_config.max_model_len = max_model_len

    return wrapper


def judge_kv_memory_by(request_bound: Callable[[object], int | None]) -> None:
    """vLLM refuses to start unless one request of ``max_model_len`` tokens fits the KV pool; where
    ``request_bound(vllm_config)`` gives fewer tokens (a policy that evicts while reading), the check
    runs with that many (``max_model_len`` is set for the call and restored)."""

    for name in KV_MEMORY_NEEDED_FUNCTIONS:
        function = getattr(kv_cache_utils, name)
        if not getattr(function, _REPLACED, False):
            replaced = judged_on_bound(function, request_bound)
            setattr(replaced, _REPLACED, True)
            setattr(kv_cache_utils, name, replaced)


def reserve_for_admissions(kv_cache_manager, reserved: Callable[[Any, int], int]) -> None:
    """Admit a request (one that holds no block yet) only if ``reserved(request, tokens)`` blocks stay free
    besides, ``tokens`` being those its slots cover once this allocation is made (a first prompt chunk).

    ``KVCacheManager.allocate_slots`` already takes ``reserved_blocks``, blocks an allocation must leave
    free; the scheduler passes it only for asynchronous KV loads. Running requests' allocations are left
    as they are.
    """
    allocate = kv_cache_manager.allocate_slots
    holders = kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks

    @functools.wraps(allocate)
    def allocate_slots(request, num_new_tokens, *args, reserved_blocks: int = 0, **kwargs):
        if request.request_id not in holders:
            computed = kwargs.get("num_new_computed_tokens", 0) + kwargs.get("num_external_computed_tokens", 0)
            reserved_blocks += reserved(request, request.num_computed_tokens + computed + num_new_tokens)
        return allocate(request, num_new_tokens, *args, reserved_blocks=reserved_blocks, **kwargs)

    kv_cache_manager.allocate_slots = allocate_slots


def forbid_full_graphs_while(runner, busy: Callable[[], bool]) -> None:
    """Make the runner's CUDA-graph dispatcher (``dispatch``, which picks a step's graph from its batch
    shape) leave out full graphs while ``busy()``: piecewise graphs then run with attention called
    eagerly, as vLLM does for an encoder-decoder step (``invalid_modes``). A call that names its modes (a
    data-parallel re-dispatch to the mode the ranks agreed on) is left as it is."""
    dispatcher = getattr(runner, "cudagraph_dispatcher", None)
    if dispatcher is None:
        return
    dispatch = dispatcher.dispatch

    def dispatch_unless_busy(*args, valid_modes=None, invalid_modes=None, **kwargs):
        if valid_modes is None and busy():
            invalid_modes = {*(invalid_modes or ()), CUDAGraphMode.FULL}
        return dispatch(*args, valid_modes=valid_modes, invalid_modes=invalid_modes, **kwargs)

    dispatcher.dispatch = dispatch_unless_busy
