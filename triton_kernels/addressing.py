"""Shared by the kernels here: the element offsets of K or V rows at slots (the Triton side of
PageGeometry) and the K and V rows loaded there, the slots a page table gives positions, pointers to rows
of a [T, H, D] tensor, the mask of a tile of rows, and whether a kernel's ``tl.dot`` may take the cache's
own dtype."""

import os

import torch
import triton
import triton.language as tl


def dot_in_cache_dtype(cache: torch.Tensor) -> bool:
    """bf16/fp16 caches feed ``tl.dot`` in their dtype on a GPU; the interpreter computes half types as
    integers, so under ``TRITON_INTERPRET=1`` (and for float32 caches) the kernels use float32."""
    return cache.dtype in (torch.float16, torch.bfloat16) and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def slot_offsets(slots, dims, block_size, heads_per_block, block_stride, head_stride, offset, token_stride, dim_stride):
    """Flat offsets [n, dims] (int64) of the K or V rows at ``slots`` [n]: PageGeometry.element_index in Triton."""
    slots = slots.to(tl.int64)
    page = slots // block_size
    token = slots % block_size
    base = (page // heads_per_block) * block_stride + (page % heads_per_block) * head_stride
    return (base + offset + token * token_stride)[:, None] + dims.to(tl.int64)[None, :] * dim_stride


@triton.jit
def kv_offsets(
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
):
    """``slot_offsets`` of the K rows and of the V rows at ``slots``, from the ints of PageGeometry.addressing."""
    k_at = slot_offsets(
        slots, dims, block_size, heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride
    )
    v_at = slot_offsets(
        slots, dims, block_size, heads_per_block, block_stride, head_stride, v_offset, v_token_stride, v_dim_stride
    )
    return k_at, v_at


@triton.jit
def load_kv_rows(
    cache_ptr,
    slots,
    dims,
    mask,
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
):
    """The K and the V rows [n, dims] at ``slots``, 0 where masked. K is addressed and loaded before V's
    offsets are computed: the order the attention loops were tuned in (it shapes the compiled schedule)."""
    k = tl.load(
        cache_ptr
        + slot_offsets(
            slots, dims, block_size, heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride
        ),
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        cache_ptr
        + slot_offsets(
            slots, dims, block_size, heads_per_block, block_stride, head_stride, v_offset, v_token_stride, v_dim_stride
        ),
        mask=mask,
        other=0.0,
    )
    return k, v


@triton.jit
def table_slots(table_ptr, row, table_stride, positions, mask, block_size):
    """Slots [n] (int64) of token ``positions`` [n] of page-table row ``row``; the table is read where ``mask``."""
    page = tl.load(table_ptr + row * table_stride + positions // block_size, mask=mask, other=0).to(tl.int64)
    return page * block_size + positions % block_size


@triton.jit
def row_pointers(ptr, token, head, dims, stride_t, stride_h, stride_d):
    """Pointers [n, dims] to rows ``[token, head, :]`` of a [T, H, D] tensor; ``token`` scalar or [n], ``head`` [n]."""
    return ptr + (token * stride_t + head * stride_h)[:, None] + dims[None, :] * stride_d


@triton.jit
def tile_mask(row_ok, dim_ok, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr):
    """The mask of a [rows, HEAD_PAD] tile: constant along the head dimension when no dimension is padding,
    so the loads vectorise."""
    if HEAD_SIZE == HEAD_PAD:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & dim_ok[None, :]
    return mask
