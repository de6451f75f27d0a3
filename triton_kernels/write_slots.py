"""Store new tokens' K and V, row by row, at the slots a per-head page table chose for them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .addressing import kv_offsets, row_pointers
from .geometry import PageGeometry, flat
from .launch import steady_jit

ROWS = 16


@steady_jit
def _write_slots_kernel(
    cache_ptr,
    key_ptr,
    value_ptr,
    token_of_ptr,
    head_of_ptr,
    slots_ptr,
    rows,
    key_stride_t,
    key_stride_h,
    key_stride_d,
    value_stride_t,
    value_stride_h,
    value_stride_d,
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
    ROWS: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    slots = tl.load(slots_ptr + row, mask=row_ok, other=-1)
    row_ok &= slots >= 0  # a padded row of a fixed-shape decode step: no slot, nothing to write
    token = tl.load(token_of_ptr + row, mask=row_ok, other=0).to(tl.int64)
    head = tl.load(head_of_ptr + row, mask=row_ok, other=0).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    mask = row_ok[:, None] & (dims < head_size)[None, :]
    key = tl.load(row_pointers(key_ptr, token, head, dims, key_stride_t, key_stride_h, key_stride_d), mask=mask)
    value = tl.load(
        row_pointers(value_ptr, token, head, dims, value_stride_t, value_stride_h, value_stride_d), mask=mask
    )
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
    tl.store(cache_ptr + k_at, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + v_at, value.to(cache_ptr.dtype.element_ty), mask=mask)


def write_slots(
    cache: torch.Tensor,
    geom: PageGeometry,
    key: torch.Tensor,
    value: torch.Tensor,
    token_of: torch.Tensor,
    head_of: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Row i: ``key[token_of[i], head_of[i]]`` and its value go to slot ``slots[i]``; key/value [T, Hkv, D].
    A negative slot writes nothing (vLLM's padding convention)."""
    rows = slots.numel()
    if rows == 0:
        return
    _write_slots_kernel[(triton.cdiv(rows, ROWS),)](
        cache,
        key,
        value,
        token_of,
        head_of,
        slots,
        rows,
        *key.stride(),
        *value.stride(),
        geom.head_size,
        *geom.addressing(),
        ROWS=ROWS,
        HEAD_PAD=triton.next_power_of_2(geom.head_size),
    )


def write_slots_reference(cache, geom, key, value, token_of, head_of, slots) -> None:
    """Plain torch: index the rows out of key/value and assign them at the slots' flat offsets."""
    storage = flat(cache)
    kept = slots >= 0
    token, head, slots = token_of[kept].long(), head_of[kept].long(), slots[kept]
    storage[geom.element_index(slots)] = key[token, head].to(cache.dtype)
    storage[geom.element_index(slots, value=True)] = value[token, head].to(cache.dtype)
