"""Causal attention of virtual tokens (one KV head's query heads of one batch token) over one-head pages.

A virtual sequence is one KV head of one request, with its own length and
page table, so every KV head may keep a different number of tokens. One
program serves one virtual token: its G query heads form a [G, D] tile that
walks the sequence's pages with an online softmax. The page count is read
from memory, not passed from the host, so a captured CUDA graph replays
correctly for any lengths.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .addressing import group_query, page_logits, slot_offsets
from .geometry import PageGeometry, flat


@triton.jit
def _paged_attention_kernel(
    query_ptr, out_ptr, cache_ptr,
    token_of_ptr, head_of_ptr, seq_of_ptr, query_start_ptr, seq_lens_ptr, page_table_ptr,
    q_stride_t, q_stride_h, q_stride_d, o_stride_t, o_stride_h, o_stride_d, table_stride,
    qk_scale, group, head_size,
    block_size, heads_per_block, block_stride, head_stride,
    k_offset, k_token_stride, k_dim_stride, v_offset, v_token_stride, v_dim_stride,
    GROUP_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    token = tl.load(token_of_ptr + row).to(tl.int64)
    kv_head = tl.load(head_of_ptr + row).to(tl.int64)
    seq = tl.load(seq_of_ptr + row).to(tl.int64)
    first = tl.load(query_start_ptr + seq).to(tl.int64)
    count = tl.load(query_start_ptr + seq + 1).to(tl.int64) - first
    # This token sits at position seq_len - count + (row - first) and sees keys up to it, inclusive.
    visible = tl.load(seq_lens_ptr + seq).to(tl.int64) - count + (row - first) + 1

    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_PAD)
    head_ok = heads < group
    dim_ok = dims < head_size
    q_heads = kv_head * group + heads
    q = group_query(query_ptr, token, kv_head, group, heads, dims, head_ok, dim_ok, q_stride_t, q_stride_h, q_stride_d,
                    qk_scale)

    best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_PAD), tl.float32)
    tokens = tl.arange(0, PAGE_PAD)
    num_pages = tl.cdiv(visible, block_size)
    for p in range(0, num_pages):
        page = tl.load(page_table_ptr + seq * table_stride + p).to(tl.int64)
        logits, live = page_logits(q, cache_ptr, page, p * block_size, visible, tokens, dims, dim_ok, block_size,
                                   heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride)
        v = tl.load(
            cache_ptr + slot_offsets(page * block_size + tokens, dims, block_size, heads_per_block, block_stride,
                                     head_stride, v_offset, v_token_stride, v_dim_stride),
            mask=live[:, None] & dim_ok[None, :], other=0.0,
        ).to(tl.float32)
        # Every page in the loop holds a visible key, so the new maximum is finite.
        new_best = tl.maximum(best, tl.max(logits, axis=1))
        rescale = tl.exp2(best - new_best)
        weights = tl.exp2(logits - new_best[:, None])
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        best = new_best

    result = acc / total[:, None]
    tl.store(
        out_ptr + token * o_stride_t + q_heads[:, None] * o_stride_h + dims[None, :] * o_stride_d,
        result.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dim_ok[None, :],
    )


def paged_attention(
    query: torch.Tensor,
    out: torch.Tensor,
    cache: torch.Tensor,
    geom: PageGeometry,
    token_of: torch.Tensor,
    head_of: torch.Tensor,
    seq_of: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    num_kv_heads: int,
) -> None:
    """Write into ``out`` [T, Hq, D] the causal paged attention of every virtual token (see module docstring).

    Virtual token i is query heads ``head_of[i]*G .. +G`` of batch token
    ``token_of[i]``; it belongs to virtual sequence ``seq_of[i]``, which owns
    virtual tokens ``query_start_loc[s] .. query_start_loc[s+1]`` (the last
    positions of its ``seq_lens[s]`` keys, on pages ``page_table[s]``).
    """
    rows = token_of.numel()
    if rows == 0:
        return
    group = query.shape[1] // num_kv_heads
    _paged_attention_kernel[(rows,)](
        query, out, cache,
        token_of, head_of, seq_of, query_start_loc, seq_lens, page_table,
        *query.stride(), *out.stride(), page_table.stride(0),
        scale * math.log2(math.e), group, geom.head_size,
        *geom.addressing(),
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_PAD=triton.next_power_of_2(geom.head_size),
        PAGE_PAD=triton.next_power_of_2(geom.block_size),
    )


def paged_attention_reference(
    query, out, cache, geom, token_of, head_of, seq_of, query_start_loc, seq_lens, page_table, scale, num_kv_heads
) -> None:
    """Plain torch, one virtual token at a time: softmax(q K^T * scale) V over the keys at positions <= its own."""
    group = query.shape[1] // num_kv_heads
    storage = flat(cache)
    for i in range(token_of.numel()):
        seq = int(seq_of[i])
        first, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        position = int(seq_lens[seq]) - (end - first) + (i - first)
        keys_at = torch.arange(position + 1, device=cache.device)
        slots = page_table[seq].long()[keys_at // geom.block_size] * geom.block_size + keys_at % geom.block_size
        k = storage[geom.element_index(slots)].float()
        v = storage[geom.element_index(slots, value=True)].float()
        heads = slice(int(head_of[i]) * group, (int(head_of[i]) + 1) * group)
        q = query[int(token_of[i]), heads].float()
        weights = torch.softmax(q @ k.T * scale, dim=-1)
        out[int(token_of[i]), heads] = (weights @ v).to(out.dtype)
