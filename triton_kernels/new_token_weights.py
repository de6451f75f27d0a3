"""H2O's decode-time accumulation: each new token's attention weights over its KV head's paged keys.

The fused attention kernel returns no weights, so they are recomputed here:
one program per sequence (one KV head of one request) makes two passes over
its pages, the first for each query head's softmax maximum and sum, the
second for the weights, averaged over the query heads of the KV head.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .addressing import group_query, page_logits, softmax_stats
from .geometry import PageGeometry, flat


@triton.jit
def _new_token_weights_kernel(
    out_ptr, query_ptr, cache_ptr, token_of_ptr, head_of_ptr, page_table_ptr, seq_lens_ptr,
    out_stride, q_stride_t, q_stride_h, q_stride_d, table_stride,
    qk_scale, group, head_size,
    block_size, heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride,
    GROUP_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    token = tl.load(token_of_ptr + seq).to(tl.int64)
    kv_head = tl.load(head_of_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_PAD)
    head_ok = heads < group
    dim_ok = dims < head_size
    q = group_query(query_ptr, token, kv_head, group, heads, dims, head_ok, dim_ok, q_stride_t, q_stride_h, q_stride_d,
                    qk_scale)
    tokens = tl.arange(0, PAGE_PAD)
    pages_ptr = page_table_ptr + seq * table_stride
    best, total = softmax_stats(q, cache_ptr, pages_ptr, seq_len, tokens, dims, dim_ok, block_size, heads_per_block,
                                block_stride, head_stride, k_offset, k_token_stride, k_dim_stride)

    # Padding heads get weight 0, so the sum over the tile divided by G is the group mean.
    norm = tl.where(head_ok, 1.0 / (total * group), 0.0)
    for p in range(0, tl.cdiv(seq_len, block_size)):
        page = tl.load(pages_ptr + p).to(tl.int64)
        logits, live = page_logits(q, cache_ptr, page, p * block_size, seq_len, tokens, dims, dim_ok, block_size,
                                   heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride)
        weights = tl.sum(tl.exp2(logits - best[:, None]) * norm[:, None], axis=0)
        tl.store(out_ptr + seq * out_stride + p * block_size + tokens, weights, mask=live)


def new_token_weights(
    query: torch.Tensor,
    cache: torch.Tensor,
    geom: PageGeometry,
    token_of: torch.Tensor,
    head_of: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_heads: int,
) -> torch.Tensor:
    """[S, pages * block_size] float32: sequence s's new-token softmax weights, its G query heads averaged.

    Sequence s is KV head ``head_of[s]`` of the request whose new token is
    batch token ``token_of[s]`` (query [T, Hq, D]); its ``seq_lens[s]`` keys,
    the new token's own last, are on pages ``page_table[s]``. 0 past the length.
    """
    seqs = token_of.numel()
    out = torch.zeros(seqs, page_table.shape[1] * geom.block_size, dtype=torch.float32, device=query.device)
    if seqs == 0:
        return out
    group = query.shape[1] // num_kv_heads
    _new_token_weights_kernel[(seqs,)](
        out, query, cache, token_of, head_of, page_table, seq_lens,
        out.stride(0), *query.stride(), page_table.stride(0),
        scale * math.log2(math.e), group, geom.head_size,
        *geom.key_addressing(),
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_PAD=triton.next_power_of_2(geom.head_size),
        PAGE_PAD=triton.next_power_of_2(geom.block_size),
    )
    return out


def new_token_weights_reference(
    query, cache, geom, token_of, head_of, page_table, seq_lens, scale, num_kv_heads
) -> torch.Tensor:
    """Plain torch, one sequence at a time: mean over the G heads of softmax(q K^T * scale) over its keys."""
    group = query.shape[1] // num_kv_heads
    storage = flat(cache)
    out = torch.zeros(token_of.numel(), page_table.shape[1] * geom.block_size, device=query.device)
    for s in range(token_of.numel()):
        n = int(seq_lens[s])
        positions = torch.arange(n, device=cache.device)
        slots = page_table[s].long()[positions // geom.block_size] * geom.block_size + positions % geom.block_size
        keys = storage[geom.element_index(slots)].float()
        head = int(head_of[s])
        q = query[int(token_of[s]), head * group : (head + 1) * group].float()
        out[s, :n] = torch.softmax(q @ keys.T * scale, dim=-1).mean(dim=0)
    return out
