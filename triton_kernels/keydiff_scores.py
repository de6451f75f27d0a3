"""KeyDiff scores, -cos(key, anchor), over dense keys [H, n, D] (any strides), in float32.

The anchor (normalised mean of the normalised keys) needs every key of the
head before any score, so it is its own launch, one program per head; the
scores then run in parallel over tiles of keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_TILE = 64
# F.normalize's floor on the norm.
EPS = 1e-12


@triton.jit
def _unit_keys(
    keys_ptr,
    head,
    stride_h,
    stride_n,
    stride_d,
    start,
    count,
    head_size,
    eps,
    KEY_TILE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Keys ``start .. start + KEY_TILE`` of ``head`` divided by max(norm, eps), zero rows past ``count``."""
    positions = start + tl.arange(0, KEY_TILE)
    dims = tl.arange(0, HEAD_PAD)
    live = positions < count
    k = tl.load(
        keys_ptr + head * stride_h + positions[:, None].to(tl.int64) * stride_n + dims[None, :] * stride_d,
        mask=live[:, None] & (dims < head_size)[None, :],
        other=0.0,
    ).to(tl.float32)
    norm = tl.maximum(tl.sqrt(tl.sum(k * k, axis=1)), eps)
    return k / norm[:, None], positions, live


@triton.jit
def _keydiff_anchor_kernel(
    keys_ptr,
    anchor_ptr,
    stride_h,
    stride_n,
    stride_d,
    count,
    head_size,
    eps,
    KEY_TILE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    total = tl.zeros((HEAD_PAD,), tl.float32)
    for start in range(0, count, KEY_TILE):
        unit, positions, live = _unit_keys(
            keys_ptr, head, stride_h, stride_n, stride_d, start, count, head_size, eps, KEY_TILE, HEAD_PAD
        )
        total += tl.sum(unit, axis=0)
    mean = total / count
    anchor = mean / tl.maximum(tl.sqrt(tl.sum(mean * mean, axis=0)), eps)
    dims = tl.arange(0, HEAD_PAD)
    tl.store(anchor_ptr + head * HEAD_PAD + dims, anchor)


@triton.jit
def _keydiff_score_kernel(
    keys_ptr,
    anchor_ptr,
    scores_ptr,
    stride_h,
    stride_n,
    stride_d,
    count,
    head_size,
    eps,
    KEY_TILE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    unit, positions, live = _unit_keys(
        keys_ptr,
        head,
        stride_h,
        stride_n,
        stride_d,
        tl.program_id(1) * KEY_TILE,
        count,
        head_size,
        eps,
        KEY_TILE,
        HEAD_PAD,
    )
    anchor = tl.load(anchor_ptr + head * HEAD_PAD + tl.arange(0, HEAD_PAD))
    tl.store(scores_ptr + head * count + positions, -tl.sum(unit * anchor[None, :], axis=1), mask=live)


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """[H, n] float32 ``-cos(key, anchor)``: kvpolicy.policies.keydiff.keydiff_scores (float64 there)."""
    heads, count, head_size = keys.shape
    head_pad = triton.next_power_of_2(head_size)
    anchor = torch.empty(heads, head_pad, dtype=torch.float32, device=keys.device)
    scores = torch.empty(heads, count, dtype=torch.float32, device=keys.device)
    if count == 0:
        return scores
    args = (*keys.stride(), count, head_size, EPS)
    _keydiff_anchor_kernel[(heads,)](keys, anchor, *args, KEY_TILE=KEY_TILE, HEAD_PAD=head_pad)
    _keydiff_score_kernel[(heads, triton.cdiv(count, KEY_TILE))](
        keys, anchor, scores, *args, KEY_TILE=KEY_TILE, HEAD_PAD=head_pad
    )
    return scores


def keydiff_scores_reference(keys: torch.Tensor) -> torch.Tensor:
    """Plain torch in float64, head by head: unit keys, their normalised mean, minus each unit key's dot with it."""
    scores = torch.empty(keys.shape[:2], dtype=torch.float64, device=keys.device)
    for head, k in enumerate(keys.double()):
        unit = k / k.norm(dim=-1, keepdim=True).clamp_min(EPS)
        mean = unit.mean(dim=0)
        anchor = mean / mean.norm().clamp_min(EPS)
        scores[head] = -(unit @ anchor)
    return scores
