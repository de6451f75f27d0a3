"""The logits of a new token's query heads against their KV head's paged keys, read in place.

H2O's new-token weights and OmniKV's filter-layer scores both need a softmax
over every key of a sequence, which the fused attention does not return. One
program serves one BLOCK_N-key tile of one sequence (its keys may span
several pages, each looked up in the table), so a long context spreads over
the whole GPU; the softmax and the reductions over query heads then run as
plain torch on the [sequences, G, keys] logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .addressing import dot_in_cache_dtype, slot_offsets, table_slots, tile_mask
from .attention_math import key_logits, load_queries
from .geometry import PageGeometry
from .launch import steady_jit

BLOCK_N = 128


@steady_jit
def _group_logits_kernel(
    out_ptr,
    query_ptr,
    cache_ptr,
    token_of_ptr,
    head_of_ptr,
    page_table_ptr,
    lengths_ptr,
    out_stride_s,
    out_stride_h,
    q_stride_t,
    q_stride_h,
    q_stride_d,
    table_stride,
    scale,
    group,
    block_size,
    heads_per_block,
    block_stride,
    head_stride,
    k_offset,
    k_token_stride,
    k_dim_stride,
    HEAD_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * BLOCK_N
    length = tl.load(lengths_ptr + seq).to(tl.int64)
    if first >= length:
        return
    token = tl.load(token_of_ptr + seq).to(tl.int64)
    heads = tl.load(head_of_ptr + seq).to(tl.int64) * group + tl.arange(0, ROWS)
    head_ok = tl.arange(0, ROWS) < group
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = load_queries(
        query_ptr, cache_ptr, token, heads, head_ok, dims, dim_ok, q_stride_t, q_stride_h, q_stride_d, LOW_PRECISION
    )
    keys = first + tl.arange(0, BLOCK_N)
    key_ok = keys < length
    slots = table_slots(page_table_ptr, seq, table_stride, keys, key_ok, block_size)
    k_at = slot_offsets(
        slots, dims, block_size, heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride
    )
    k = tl.load(cache_ptr + k_at, mask=tile_mask(key_ok, dim_ok, HEAD_SIZE, HEAD_PAD), other=0.0)
    logits = key_logits(q, k, scale, LOW_PRECISION)
    rows = tl.arange(0, ROWS)
    tl.store(
        out_ptr + seq * out_stride_s + rows[:, None] * out_stride_h + keys[None, :],
        logits,
        mask=head_ok[:, None] & key_ok[None, :],
    )


def group_logits(
    query: torch.Tensor,
    cache: torch.Tensor,
    geom: PageGeometry,
    token_of: torch.Tensor,
    head_of: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    group: int,
) -> torch.Tensor:
    """[S, G, pages * block_size] float32: ``scale * q.k`` of batch token ``token_of[s]``'s query heads
    ``head_of[s]*G .. +G`` (query [T, Hq, D]) against the first ``lengths[s]`` keys on pages
    ``page_table[s]``; -inf past the length."""
    seqs, pages = page_table.shape
    out = torch.full((seqs, group, pages * geom.block_size), float("-inf"), dtype=torch.float32, device=query.device)
    if seqs == 0:
        return out
    low_precision = dot_in_cache_dtype(cache)
    _group_logits_kernel[(seqs, triton.cdiv(out.shape[2], BLOCK_N))](
        out,
        query,
        cache,
        token_of,
        head_of,
        page_table,
        lengths,
        out.stride(0),
        out.stride(1),
        *query.stride(),
        page_table.stride(0),
        scale,
        group,
        *geom.key_addressing(),
        HEAD_SIZE=geom.head_size,
        ROWS=max(16, triton.next_power_of_2(group)),
        HEAD_PAD=max(16, triton.next_power_of_2(geom.head_size)),
        BLOCK_N=BLOCK_N,
        LOW_PRECISION=low_precision,
    )
    return out
