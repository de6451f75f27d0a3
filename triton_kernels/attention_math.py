"""Shared by the attention kernels here: a query tile loaded as a dot operand, its logits against a tile of
keys, weights times a tile of values, and one step of an online softmax over a tile of logits.

``LOW_PRECISION`` (``addressing.dot_in_cache_dtype``) feeds ``tl.dot`` in the cache's dtype; otherwise
both operands are float32 and the dot is IEEE float32 (not TF32)."""

import triton
import triton.language as tl

from .addressing import row_pointers


@triton.jit
def load_queries(
    query_ptr, cache_ptr, token, head, row_ok, dims, dim_ok, stride_t, stride_h, stride_d, LOW_PRECISION: tl.constexpr
):
    """Rows ``query[token, head, :]`` [n, dims], 0 where masked, in the dtype the dots with the cache take."""
    q = tl.load(
        row_pointers(query_ptr, token, head, dims, stride_t, stride_h, stride_d),
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    return q.to(cache_ptr.dtype.element_ty) if LOW_PRECISION else q.to(tl.float32)


@triton.jit
def key_logits(q, k, scale, LOW_PRECISION: tl.constexpr):
    """``q @ k^T * scale`` [rows, keys] float32 for queries [rows, D] (from ``load_queries``) and keys [keys, D]."""
    if LOW_PRECISION:
        logits = tl.dot(q, tl.trans(k)) * scale
    else:
        logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    return logits


@triton.jit
def weighted_values(weights, v, LOW_PRECISION: tl.constexpr):
    """``weights @ v`` [rows, D] float32 for float32 weights [rows, keys] and values [keys, D] from the cache;
    in low precision the weights are rounded to the cache's dtype first, as in FlashAttention."""
    if LOW_PRECISION:
        product = tl.dot(weights.to(v.dtype), v)
    else:
        product = tl.dot(weights, v.to(tl.float32), input_precision="ieee")
    return product


@triton.jit
def softmax_step(best, total, logits, EXP2: tl.constexpr):
    """Fold logits [rows, keys] (-inf where masked) into a running maximum ``best`` and sum ``total`` [rows].

    Returns the new maximum and sum, the tile's weights and the factor that rescales what was summed before.
    Base 2 when ``EXP2`` (logits pre-scaled by log2(e)), else base e. A row with no live key yet keeps a -inf
    maximum and is shifted by 0, so its weights are 0, not NaN.
    """
    new_best = tl.maximum(best, tl.max(logits, axis=1))
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)
    if EXP2:
        weights = tl.exp2(logits - shift[:, None])
        rescale = tl.exp2(best - shift)
    else:
        weights = tl.exp(logits - shift[:, None])
        rescale = tl.exp(best - shift)
    return new_best, total * rescale + tl.sum(weights, axis=1), weights, rescale


@triton.jit
def attend_step(best, total, acc, logits, v, EXP2: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """``softmax_step`` plus the weighted values: the running (maximum, sum, unnormalised output [rows, D])."""
    best, total, weights, rescale = softmax_step(best, total, logits, EXP2)
    return best, total, acc * rescale[:, None] + weighted_values(weights, v, LOW_PRECISION)
