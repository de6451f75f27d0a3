"""How the engine's kernels are compiled: one variant per set of compile-time constants, nothing more.

Triton compiles a kernel again for every new *specialization* of its arguments: each integer argument that is 1 or a
multiple of 16, each pointer that is 16-byte aligned. In the engine those change from step to step, so a run would
compile new variants while it serves, each compile stalling a step for seconds. A kernel made with ``steady_jit`` is
specialized on its ``tl.constexpr`` arguments, the caller's choice among a few tilings, which a warm-up can launch once
each, and on the arguments that never change while an engine serves: the pointers named in ``ALIGNED`` always start a
whole tensor (the KV cache, the step's queries and output) and keep their alignment hint, and the integers named in
``STABLE`` (a page's token layout, the model's tensor strides) keep theirs (1, or a multiple of 16): knowing a head's
elements contiguous is what lets the loads along it vectorize.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

#: Pointers every engine kernel gets at a tensor's start (16-byte aligned in every call).
ALIGNED = ("cache_ptr", "query_ptr", "out_ptr")
#: Integers fixed for an engine: how a token's K and V lie in a page (``PageGeometry.addressing``) and the
#: strides of the model's activations, the same in the warm-up as in every step; Triton specializes them as
#: it would. Not the pages' own strides and heads per block: the sharing path views the whole KV buffer as
#: one-head pages where the others view a layer's cache.
STABLE = frozenset(
    {
        "block_size",
        "head_size",
        "k_offset",
        "k_token_stride",
        "k_dim_stride",
        "v_offset",
        "v_token_stride",
        "v_dim_stride",
        *(f"{tensor}_stride_{dim}" for tensor in ("q", "o") for dim in "thd"),
        *(f"{tensor}_stride_{dim}" for tensor in ("key", "value") for dim in "thd"),
    }
)


def _is_constexpr(annotation) -> bool:
    return annotation is tl.constexpr or annotation in ("tl.constexpr", "constexpr")


#: Every kernel made with ``steady_jit``, for a warm-up's test to watch.
STEADY_KERNELS: list = []


def steady_jit(fn):
    """``triton.jit`` without value or alignment specialization of the runtime arguments that change between
    steps (module docstring)."""
    runtime = [name for name in _runtime_arguments(fn) if name not in STABLE]
    kernel = triton.jit(
        fn,
        do_not_specialize=runtime,
        do_not_specialize_on_alignment=[name for name in runtime if name not in ALIGNED],
    )
    STEADY_KERNELS.append(kernel)
    return kernel


def _runtime_arguments(fn) -> list[str]:
    return [name for name, p in inspect.signature(fn).parameters.items() if not _is_constexpr(p.annotation)]


def specialization(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a ``steady_jit`` kernel's launch for: its constants, its launch settings, each
    tensor's dtype (and, for the pointers in ``ALIGNED``, 16-byte alignment), each ``STABLE`` integer's class
    (1, a multiple of 16, or neither), each other argument's type."""
    fn = kernel.fn
    names = list(inspect.signature(fn).parameters)
    runtime = set(_runtime_arguments(fn))
    key = [fn.__name__]
    for name, value in [*zip(names, args), *sorted(kwargs.items())]:
        if name not in runtime:
            key.append((name, value))
        elif name in STABLE and isinstance(value, int):
            key.append((name, value == 1, value % 16 == 0))
        elif isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype), name in ALIGNED and value.data_ptr() % 16 == 0))
        else:
            key.append((name, type(value).__name__))
    return tuple(key)
