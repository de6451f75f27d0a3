"""Read, write and move whole tokens (K and V rows) by slot: relocation packs kept tokens, D2O writes merges.

``move_tokens`` gathers every source into a scratch buffer before scattering
any of it, so sources and destinations may overlap (an in-place compaction
or permutation): the second launch starts only after the first has finished.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .addressing import kv_offsets
from .geometry import PageGeometry, flat
from .launch import steady_jit

ROWS = 16


@steady_jit
def _copy_tokens_kernel(
    cache_ptr,
    k_buf_ptr,
    v_buf_ptr,
    slots_ptr,
    rows,
    k_buf_stride_n,
    k_buf_stride_d,
    v_buf_stride_n,
    v_buf_stride_d,
    head_size,
    block_size,
    heads_per_block,
    block_stride,
    head_stride,
    k_offset,
    k_token_stride,
    k_dim_stride,
    v_offset,
    v_token_stride,
    v_dim_stride,
    TO_CACHE: tl.constexpr,
    KEYS: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Copy rows between the cache (at ``slots``) and dense buffers [rows, D]: into the cache when TO_CACHE;
    V rows only unless KEYS."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    slots = tl.load(slots_ptr + row, mask=row_ok, other=0)
    dims = tl.arange(0, HEAD_PAD)
    mask = row_ok[:, None] & (dims < head_size)[None, :]
    k_buf = k_buf_ptr + row.to(tl.int64)[:, None] * k_buf_stride_n + dims[None, :] * k_buf_stride_d
    v_buf = v_buf_ptr + row.to(tl.int64)[:, None] * v_buf_stride_n + dims[None, :] * v_buf_stride_d
    k_at, v_at = kv_offsets(
        slots,
        dims,
        block_size,
        heads_per_block,
        block_stride,
        head_stride,
        k_offset,
        k_token_stride,
        k_dim_stride,
        v_offset,
        v_token_stride,
        v_dim_stride,
    )
    k_cache = cache_ptr + k_at
    v_cache = cache_ptr + v_at
    if TO_CACHE:
        tl.store(k_cache, tl.load(k_buf, mask=mask).to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache, tl.load(v_buf, mask=mask).to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        if KEYS:
            tl.store(k_buf, tl.load(k_cache, mask=mask).to(k_buf_ptr.dtype.element_ty), mask=mask)
        tl.store(v_buf, tl.load(v_cache, mask=mask).to(v_buf_ptr.dtype.element_ty), mask=mask)


def _copy(cache, geom, slots, k, v, to_cache: bool, keys: bool = True) -> None:
    rows = slots.numel()
    if rows == 0:
        return
    _copy_tokens_kernel[(triton.cdiv(rows, ROWS),)](
        cache,
        k,
        v,
        slots,
        rows,
        *k.stride(),
        *v.stride(),
        geom.head_size,
        *geom.addressing(),
        TO_CACHE=to_cache,
        KEYS=keys,
        ROWS=ROWS,
        HEAD_PAD=triton.next_power_of_2(geom.head_size),
    )


def gather_tokens(cache: torch.Tensor, geom: PageGeometry, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the tokens at ``slots``, each [n, D] in the cache's dtype."""
    k = torch.empty(slots.numel(), geom.head_size, dtype=cache.dtype, device=cache.device)
    v = torch.empty_like(k)
    _copy(cache, geom, slots, k, v, to_cache=False)
    return k, v


def gather_values(cache: torch.Tensor, geom: PageGeometry, slots: torch.Tensor) -> torch.Tensor:
    """V of the tokens at ``slots``, [n, D] in the cache's dtype; their K is not read."""
    v = torch.empty(slots.numel(), geom.head_size, dtype=cache.dtype, device=cache.device)
    _copy(cache, geom, slots, v, v, to_cache=False, keys=False)
    return v


def scatter_tokens(
    cache: torch.Tensor, geom: PageGeometry, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write rows ``k[i]``, ``v[i]`` ([n, D]) at ``slots[i]``; the slots must be distinct."""
    _copy(cache, geom, slots, k, v, to_cache=True)


def move_tokens(cache: torch.Tensor, geom: PageGeometry, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """The token at ``src_slots[i]`` ends at ``dst_slots[i]`` (distinct destinations); the sets may overlap."""
    k, v = gather_tokens(cache, geom, src_slots)
    scatter_tokens(cache, geom, dst_slots, k, v)


def gather_tokens_reference(cache, geom, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the K and V rows at the slots' flat offsets, copied out."""
    storage = flat(cache)
    return storage[geom.element_index(slots)].clone(), storage[geom.element_index(slots, value=True)].clone()


def gather_values_reference(cache, geom, slots) -> torch.Tensor:
    """Plain torch: the V rows at the slots' flat offsets, copied out."""
    return flat(cache)[geom.element_index(slots, value=True)].clone()


def scatter_tokens_reference(cache, geom, slots, k, v) -> None:
    """Plain torch: assign the rows at the slots' flat offsets."""
    storage = flat(cache)
    storage[geom.element_index(slots)] = k.to(cache.dtype)
    storage[geom.element_index(slots, value=True)] = v.to(cache.dtype)


def move_tokens_reference(cache, geom, src_slots, dst_slots) -> None:
    """Advanced indexing reads every source before it writes: an overlap-safe copy by construction."""
    storage = flat(cache)
    for value in (False, True):
        storage[geom.element_index(dst_slots, value)] = storage[geom.element_index(src_slots, value)]
