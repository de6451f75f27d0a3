"""Triton side of PageGeometry, shared by the kernels here: a query group, element offsets, a page's logits,
softmax statistics."""

import triton
import triton.language as tl


@triton.jit
def slot_offsets(slots, dims, block_size, heads_per_block, block_stride, head_stride, offset, token_stride, dim_stride):
    """Flat offsets [n, dims] (int64) of the K or V rows at ``slots`` [n]: PageGeometry.element_index in Triton."""
    slots = slots.to(tl.int64)
    page = slots // block_size
    token = slots % block_size
    base = (page // heads_per_block) * block_stride + (page % heads_per_block) * head_stride
    return (base + offset + token * token_stride)[:, None] + dims.to(tl.int64)[None, :] * dim_stride


@triton.jit
def group_query(query_ptr, token, kv_head, group, heads, dims, head_ok, dim_ok, q_stride_t, q_stride_h, q_stride_d,
                qk_scale):
    """The query heads of KV head ``kv_head`` of batch token ``token``, [GROUP_PAD, HEAD_PAD] float32 times
    ``qk_scale`` (0 in padding)."""
    q_heads = kv_head * group + heads
    return tl.load(
        query_ptr + token * q_stride_t + q_heads[:, None] * q_stride_h + dims[None, :] * q_stride_d,
        mask=head_ok[:, None] & dim_ok[None, :], other=0.0,
    ).to(tl.float32) * qk_scale


@triton.jit
def page_logits(q, cache_ptr, page, first, length, tokens, dims, dim_ok,
                block_size, heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride):
    """Logits [heads, tokens] of ``q`` [heads, dims] against the keys of ``page``, the sequence's positions
    ``first + tokens``; -inf at positions from ``length`` on and at padding tokens. Also returns that mask."""
    live = (tokens < block_size) & (first + tokens < length)
    k = tl.load(
        cache_ptr + slot_offsets(page * block_size + tokens, dims, block_size, heads_per_block, block_stride,
                                 head_stride, k_offset, k_token_stride, k_dim_stride),
        mask=live[:, None] & dim_ok[None, :], other=0.0,
    ).to(tl.float32)
    logits = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    return tl.where(live[None, :], logits, float("-inf")), live


@triton.jit
def softmax_stats(q, cache_ptr, pages_ptr, length, tokens, dims, dim_ok,
                  block_size, heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride):
    """Per row of ``q``: max logit and sum of exp2(logit - max) over a sequence's first ``length`` keys.

    The sequence's token j is on page ``pages_ptr[j // block_size]``; ``q``
    carries the softmax scale times log2(e), so these are base-2 statistics.
    """
    best = tl.full((q.shape[0],), float("-inf"), tl.float32)
    total = tl.zeros((q.shape[0],), tl.float32)
    for p in range(0, tl.cdiv(length, block_size)):
        page = tl.load(pages_ptr + p).to(tl.int64)
        logits, live = page_logits(q, cache_ptr, page, p * block_size, length, tokens, dims, dim_ok, block_size,
                                   heads_per_block, block_stride, head_stride, k_offset, k_token_stride, k_dim_stride)
        # Every page in the loop holds a live key, so the new maximum is finite.
        new_best = tl.maximum(best, tl.max(logits, axis=1))
        total = total * tl.exp2(best - new_best) + tl.sum(tl.exp2(logits - new_best[:, None]), axis=1)
        best = new_best
    return best, total
