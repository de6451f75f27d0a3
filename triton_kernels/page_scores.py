"""OmniKV filter-layer token scores read straight from the pages: eq. (3)-(4) with the "last" selector.

One program per (row, KV head) computes its G query heads' softmax over the
head's pages in two passes (statistics, then weights) and folds the weights
into the row's scores with an atomic max: the max over all query heads of
the row, whichever KV head they read. Weights are >= 0, so a zero-filled
output is the identity of that max and stays 0 past the row's length.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .addressing import group_query, page_logits, softmax_stats
from .geometry import PageGeometry, flat


@triton.jit
def _context_token_scores_kernel(
    out_ptr, query_ptr, cache_ptr, token_idx_ptr, page_ids_ptr, lengths_ptr,
    out_stride, q_stride_t, q_stride_h, q_stride_d, pages_stride_b, pages_stride_h,
    qk_scale, group, head_size,
    block_size, heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride,
    GROUP_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    token = tl.load(token_idx_ptr + row).to(tl.int64)
    length = tl.load(lengths_ptr + row).to(tl.int64)
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_PAD)
    head_ok = heads < group
    dim_ok = dims < head_size
    q = group_query(query_ptr, token, kv_head, group, heads, dims, head_ok, dim_ok, q_stride_t, q_stride_h, q_stride_d,
                    qk_scale)
    tokens = tl.arange(0, PAGE_PAD)
    pages_ptr = page_ids_ptr + row * pages_stride_b + kv_head * pages_stride_h
    best, total = softmax_stats(q, cache_ptr, pages_ptr, length, tokens, dims, dim_ok, block_size, heads_per_block,
                                block_stride, head_stride, k_offset, k_token_stride, k_dim_stride)

    norm = tl.where(head_ok, 1.0 / total, 0.0)
    for p in range(0, tl.cdiv(length, block_size)):
        page = tl.load(pages_ptr + p).to(tl.int64)
        logits, live = page_logits(q, cache_ptr, page, p * block_size, length, tokens, dims, dim_ok, block_size,
                                   heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride)
        weights = tl.max(tl.exp2(logits - best[:, None]) * norm[:, None], axis=0)
        tl.atomic_max(out_ptr + row * out_stride + p * block_size + tokens, weights, mask=live)


def context_token_scores(
    query: torch.Tensor,
    cache: torch.Tensor,
    geom: PageGeometry,
    token_idx: torch.Tensor,
    page_ids: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[B, P * block_size] float32: per row, each token's largest softmax weight over the last token's query heads.

    Row b's last token is batch token ``token_idx[b]`` of ``query`` [T, Hq, D];
    KV head h's keys are on pages ``page_ids[b, h]`` ([B, Hkv, P]), valid up to
    ``lengths[b]``. Equals kvpolicy.policies.omnikv.context_scores with window 1.
    """
    rows, kv_heads, pages = page_ids.shape
    out = torch.zeros(rows, pages * geom.block_size, dtype=torch.float32, device=query.device)
    if rows == 0:
        return out
    group = query.shape[1] // kv_heads
    _context_token_scores_kernel[(rows, kv_heads)](
        out, query, cache, token_idx, page_ids, lengths,
        out.stride(0), *query.stride(), page_ids.stride(0), page_ids.stride(1),
        scale * math.log2(math.e), group, geom.head_size,
        *geom.key_addressing(),
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_PAD=triton.next_power_of_2(geom.head_size),
        PAGE_PAD=triton.next_power_of_2(geom.block_size),
    )
    return out


def context_token_scores_reference(query, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """Plain torch, row by row and query head by query head: the running max of softmax(q K^T * scale)."""
    rows, kv_heads, pages = page_ids.shape
    group = query.shape[1] // kv_heads
    storage = flat(cache)
    out = torch.zeros(rows, pages * geom.block_size, device=query.device)
    for b in range(rows):
        n = int(lengths[b])
        positions = torch.arange(n, device=cache.device)
        for head in range(query.shape[1]):
            table = page_ids[b, head // group].long()
            slots = table[positions // geom.block_size] * geom.block_size + positions % geom.block_size
            keys = storage[geom.element_index(slots)].float()
            weights = torch.softmax(keys @ query[int(token_idx[b]), head].float() * scale, dim=0)
            out[b, :n] = torch.maximum(out[b, :n], weights)
    return out
