"""SnapKV-family observation-window scores: the attention part in Triton, pooling and group mean in torch.

Two launches over dense keys [Hkv, L, D] (any strides): the first finds, for
every window query, the maximum and sum of its causal softmax over all L keys;
the second turns the prefix logits into weights and sums them over the
window, each program owning a tile of prefix positions. Float32 throughout,
with IEEE (not TF32) dot products so a GPU run agrees with the float64 policy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .attention_math import softmax_step

WINDOW_TILE = 16
KEY_TILE = 64


@triton.jit
def _window_logits(
    q, keys_ptr, kv_head, k_stride_h, k_stride_l, k_stride_d, start, dims, dim_ok, limit, KEY_TILE: tl.constexpr
):
    """Logits [window tile, KEY_TILE] of ``q`` (already scaled) against keys ``start ..``; -inf from ``limit``."""
    positions = start + tl.arange(0, KEY_TILE)
    k = tl.load(
        keys_ptr + kv_head * k_stride_h + positions[None, :].to(tl.int64) * k_stride_l + dims[:, None] * k_stride_d,
        mask=dim_ok[:, None] & (positions < limit)[None, :],
        other=0.0,
    ).to(tl.float32)
    return tl.dot(q, k, input_precision="ieee"), positions


@triton.jit
def _load_window(queries_ptr, head, q_stride_h, q_stride_w, q_stride_d, rows, row_ok, dims, dim_ok, qk_scale):
    return (
        tl.load(
            queries_ptr + head * q_stride_h + rows[:, None].to(tl.int64) * q_stride_w + dims[None, :] * q_stride_d,
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        * qk_scale
    )


@triton.jit
def _window_stats_kernel(
    keys_ptr,
    queries_ptr,
    best_ptr,
    total_ptr,
    k_stride_h,
    k_stride_l,
    k_stride_d,
    q_stride_h,
    q_stride_w,
    q_stride_d,
    length,
    window,
    group,
    head_size,
    qk_scale,
    WINDOW_TILE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    head = tl.program_id(0)
    rows = tl.program_id(1) * WINDOW_TILE + tl.arange(0, WINDOW_TILE)
    row_ok = rows < window
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < head_size
    q = _load_window(queries_ptr, head, q_stride_h, q_stride_w, q_stride_d, rows, row_ok, dims, dim_ok, qk_scale)
    kv_head = head // group
    # Window query w sits at position L - W + w and sees keys up to it.
    query_pos = length - window + rows
    last = tl.minimum(length - window + (tl.program_id(1) + 1) * WINDOW_TILE, length)
    best = tl.full((WINDOW_TILE,), float("-inf"), tl.float32)
    total = tl.zeros((WINDOW_TILE,), tl.float32)
    for start in range(0, last, KEY_TILE):
        logits, positions = _window_logits(
            q, keys_ptr, kv_head, k_stride_h, k_stride_l, k_stride_d, start, dims, dim_ok, length, KEY_TILE
        )
        logits = tl.where(positions[None, :] <= query_pos[:, None], logits, float("-inf"))
        best, total, _, _ = softmax_step(best, total, logits, EXP2=True)
    tl.store(best_ptr + head * window + rows, best, mask=row_ok)
    tl.store(total_ptr + head * window + rows, total, mask=row_ok)


@triton.jit
def _window_weights_kernel(
    keys_ptr,
    queries_ptr,
    best_ptr,
    total_ptr,
    sums_ptr,
    k_stride_h,
    k_stride_l,
    k_stride_d,
    q_stride_h,
    q_stride_w,
    q_stride_d,
    length,
    window,
    group,
    head_size,
    qk_scale,
    WINDOW_TILE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    head = tl.program_id(0)
    start = tl.program_id(1) * KEY_TILE
    prefix = length - window
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < head_size
    kv_head = head // group
    sums = tl.zeros((KEY_TILE,), tl.float32)
    # Prefix keys precede every window query: no causal mask, only the prefix bound.
    for first in range(0, window, WINDOW_TILE):
        rows = first + tl.arange(0, WINDOW_TILE)
        row_ok = rows < window
        q = _load_window(queries_ptr, head, q_stride_h, q_stride_w, q_stride_d, rows, row_ok, dims, dim_ok, qk_scale)
        logits, positions = _window_logits(
            q, keys_ptr, kv_head, k_stride_h, k_stride_l, k_stride_d, start, dims, dim_ok, prefix, KEY_TILE
        )
        best = tl.load(best_ptr + head * window + rows, mask=row_ok, other=0.0)
        norm = tl.where(row_ok, 1.0 / tl.load(total_ptr + head * window + rows, mask=row_ok, other=1.0), 0.0)
        sums += tl.sum(tl.exp2(logits - best[:, None]) * norm[:, None], axis=0)
    positions = start + tl.arange(0, KEY_TILE)
    tl.store(sums_ptr + head * prefix + positions, sums, mask=positions < prefix)


def window_attention_sums(keys: torch.Tensor, window_queries: torch.Tensor) -> torch.Tensor:
    """[Hq, L - W] float32: each query head's causal softmax weights on the prefix keys, summed over the window."""
    kv_heads, length, head_size = keys.shape
    q_heads, window, _ = window_queries.shape
    group = q_heads // kv_heads
    best = torch.empty(q_heads, window, dtype=torch.float32, device=keys.device)
    total = torch.empty_like(best)
    sums = torch.empty(q_heads, length - window, dtype=torch.float32, device=keys.device)
    args = (
        *keys.stride(),
        *window_queries.stride(),
        length,
        window,
        group,
        head_size,
        math.log2(math.e) / math.sqrt(head_size),
    )
    tiles = dict(WINDOW_TILE=WINDOW_TILE, KEY_TILE=KEY_TILE, HEAD_PAD=max(16, triton.next_power_of_2(head_size)))
    _window_stats_kernel[(q_heads, triton.cdiv(window, WINDOW_TILE))](keys, window_queries, best, total, *args, **tiles)
    if length > window:
        _window_weights_kernel[(q_heads, triton.cdiv(length - window, KEY_TILE))](
            keys, window_queries, best, total, sums, *args, **tiles
        )
    return sums


def window_scores(keys: torch.Tensor, window_queries: torch.Tensor, pool_kernel: int) -> torch.Tensor:
    """kvpolicy.policies.snapkv.window_scores in float32: [Hkv, L - W] prefix scores, pooled, group-averaged.

    ``keys`` [Hkv, L, D] (any strides); ``window_queries`` [Hq, W, D], the
    last W prompt queries (query head q reads KV head ``q // (Hq // Hkv)``).
    """
    kv_heads = keys.shape[0]
    sums = window_attention_sums(keys, window_queries)
    pooled = F.max_pool1d(sums[:, None], kernel_size=pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0]
    return pooled.view(kv_heads, -1, pooled.shape[-1]).mean(dim=1)


def window_scores_reference(keys: torch.Tensor, window_queries: torch.Tensor, pool_kernel: int) -> torch.Tensor:
    """Plain torch in float64, one query head and one window query at a time, pooling written as a loop."""
    kv_heads, length, dim = keys.shape
    q_heads, window, _ = window_queries.shape
    group = q_heads // kv_heads
    prefix = length - window
    half = pool_kernel // 2
    out_len = prefix + 2 * half - pool_kernel + 1
    scores = torch.zeros(kv_heads, out_len, dtype=torch.float64, device=keys.device)
    for head in range(q_heads):
        k = keys[head // group].double()
        summed = torch.zeros(prefix, dtype=torch.float64, device=keys.device)
        for w in range(window):
            seen = k[: prefix + w + 1]
            weights = torch.softmax(seen @ window_queries[head, w].double() / math.sqrt(dim), dim=0)
            summed += weights[:prefix]
        pooled = torch.stack([summed[max(0, i - half) : i - half + pool_kernel].max() for i in range(out_len)])
        scores[head // group] += pooled / group
    return scores
