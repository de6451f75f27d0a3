"""Causal attention of virtual tokens (one KV head's query heads of one batch token) over one-head pages.

A virtual sequence is one KV head of one request, with its own length and page table, so every KV head may keep a
different number of tokens. One program serves a tile of consecutive virtual tokens of one sequence: their query heads
stacked as the rows of one [BLOCK_Q * GROUP_PAD, D] tile (so a decode token's G heads fill tensor-core rows), walking
the sequence's keys BLOCK_N at a time (a tile spans several pages, each token's page looked up in the table) with an
online softmax. Long decodes are split along the keys over ``splits`` programs whose partial softmax states one
reduction merges (flash-decoding), so a small batch still fills the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .addressing import dot_in_cache_dtype, load_kv_rows, row_pointers, table_slots, tile_mask
from .attention_math import attend_step, key_logits, load_queries
from .geometry import PageGeometry, flat
from .launch import steady_jit


@dataclass(frozen=True)
class Tiling:
    """Keys per inner step, rows of the query tile, and Triton's launch settings, for one kind of call."""

    block_n: int
    rows: int
    num_warps: int
    num_stages: int


#: Decode-only calls and calls with prompt chunks, picked by a sweep on an H100 (docs/benchmarks.md).
DECODE_TILING = Tiling(block_n=128, rows=16, num_warps=4, num_stages=2)
CHUNK_TILING = Tiling(block_n=32, rows=128, num_warps=4, num_stages=3)
#: A split serves at least this many keys; the grid aims at this many programs.
MIN_SPLIT_KEYS, TARGET_PROGRAMS = 256, 1024


@steady_jit
def _paged_attention_kernel(
    query_ptr,
    out_ptr,
    cache_ptr,
    part_out_ptr,
    part_stats_ptr,
    token_of_ptr,
    head_of_ptr,
    query_start_ptr,
    seq_lens_ptr,
    page_table_ptr,
    q_stride_t,
    q_stride_h,
    q_stride_d,
    o_stride_t,
    o_stride_h,
    o_stride_d,
    table_stride,
    qk_scale,
    group,
    rows_total,
    splits,
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
    HEAD_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    first_q = tl.program_id(1) * BLOCK_Q
    split = tl.program_id(2)
    first = tl.load(query_start_ptr + seq).to(tl.int64)
    count = tl.load(query_start_ptr + seq + 1).to(tl.int64) - first
    if first_q >= count:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)

    m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_in_seq = first_q + m // GROUP_PAD
    head_in_group = m % GROUP_PAD
    row_ok = (q_in_seq < count) & (head_in_group < group)
    vrow = first + q_in_seq
    token = tl.load(token_of_ptr + vrow, mask=row_ok, other=0).to(tl.int64)
    q_head = tl.load(head_of_ptr + vrow, mask=row_ok, other=0).to(tl.int64) * group + head_in_group
    # Row m's token sits at position seq_len - count + q_in_seq and sees keys up to it, inclusive.
    position = seq_len - count + q_in_seq
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = load_queries(
        query_ptr, cache_ptr, token, q_head, row_ok, dims, dim_ok, q_stride_t, q_stride_h, q_stride_d, LOW_PRECISION
    )

    # Keys this tile needs (its last row's), cut into ``splits`` ranges of whole key blocks.
    visible = seq_len - count + tl.minimum(first_q + BLOCK_Q, count)
    per_split = tl.cdiv(tl.cdiv(visible, BLOCK_N), splits) * BLOCK_N
    start = split * per_split
    stop = tl.minimum(start + per_split, visible)

    best = tl.full((BLOCK_Q * GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_Q * GROUP_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_Q * GROUP_PAD, HEAD_PAD), tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for key_start in range(start, stop, BLOCK_N):
        j = key_start + keys
        key_ok = j < stop
        slots = table_slots(page_table_ptr, seq, table_stride, j, key_ok, block_size)
        kv_mask = tile_mask(key_ok, dim_ok, HEAD_SIZE, HEAD_PAD)
        k, v = load_kv_rows(
            cache_ptr,
            slots,
            dims,
            kv_mask,
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
        logits = key_logits(q, k, qk_scale, LOW_PRECISION)
        live = key_ok[None, :] & (j[None, :] <= position[:, None]) & row_ok[:, None]
        logits = tl.where(live, logits, float("-inf"))
        best, total, acc = attend_step(best, total, acc, logits, v, EXP2=True, LOW_PRECISION=LOW_PRECISION)

    if not SPLIT:
        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            row_pointers(out_ptr, token, q_head, dims, o_stride_t, o_stride_h, o_stride_d),
            result.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # Partial state of virtual token vrow and query head, indexed [split, vrow, head in group].
        part = (split * rows_total + vrow) * GROUP_PAD + head_in_group
        tl.store(part_out_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_stats_ptr + 2 * part, best, mask=row_ok)
        tl.store(part_stats_ptr + 2 * part + 1, total, mask=row_ok)


@steady_jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_stats_ptr,
    token_of_ptr,
    head_of_ptr,
    o_stride_t,
    o_stride_h,
    o_stride_d,
    group,
    head_size,
    rows_total,
    splits,
    GROUP_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """One virtual token: merge its ``splits`` partial softmax states (max, sum, weighted values) into the output."""
    vrow = tl.program_id(0)
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_PAD)
    head_ok = heads < group
    best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_PAD), tl.float32)
    for split in range(splits):
        part = (split * rows_total + vrow) * GROUP_PAD + heads
        # A split past the sequence's keys ran no step: its (-inf, 0) state adds nothing.
        part_best = tl.load(part_stats_ptr + 2 * part, mask=head_ok, other=float("-inf"))
        part_total = tl.load(part_stats_ptr + 2 * part + 1, mask=head_ok, other=0.0)
        part_acc = tl.load(part_out_ptr + part[:, None] * HEAD_PAD + dims[None, :], mask=head_ok[:, None], other=0.0)
        new_best = tl.maximum(best, part_best)
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        old_scale, part_scale = tl.exp2(best - shift), tl.exp2(part_best - shift)
        total = total * old_scale + part_total * part_scale
        acc = acc * old_scale[:, None] + part_acc * part_scale[:, None]
        best = new_best
    token = tl.load(token_of_ptr + vrow).to(tl.int64)
    q_head = tl.load(head_of_ptr + vrow).to(tl.int64) * group + heads
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        row_pointers(out_ptr, token, q_head, dims, o_stride_t, o_stride_h, o_stride_d),
        result.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & (dims < head_size)[None, :],
    )


def decode_workspace(parts: int, group: int, head_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for ``parts`` (split, virtual token) partial softmax states of a split decode: weighted values
    and (max, sum). A split decode of ``rows`` tokens over ``splits`` splits needs ``splits * rows``;
    no decode needs more than ``TARGET_PROGRAMS``."""
    group_pad, head_pad = triton.next_power_of_2(group), max(16, triton.next_power_of_2(head_size))
    values = torch.empty(parts, group_pad, head_pad, dtype=torch.float32, device=device)
    return values, torch.empty(parts, group_pad, 2, dtype=torch.float32, device=device)


def paged_attention(
    query: torch.Tensor,
    out: torch.Tensor,
    cache: torch.Tensor,
    geom: PageGeometry,
    token_of: torch.Tensor,
    head_of: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write into ``out`` [T, Hq, D] the causal paged attention of every virtual token (see module docstring).

    Virtual token i is query heads ``head_of[i]*G .. +G`` of batch token
    ``token_of[i]``; virtual sequence s owns virtual tokens
    ``query_start_loc[s] .. query_start_loc[s+1]`` (the last positions of its
    ``seq_lens[s]`` keys, on pages ``page_table[s]``). The two maxima size the
    grid; callers that know them on the host pass them (else read back here). ``workspace``
    (``decode_workspace``): where a split decode keeps its partial states, instead of memory taken
    at each call (a CUDA graph's replays then read and write the same addresses).
    """
    rows = token_of.numel()
    if rows == 0:
        return
    seqs = query_start_loc.numel() - 1
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    group = query.shape[1] // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(geom.head_size))
    tiling = DECODE_TILING if max_query_len == 1 else CHUNK_TILING
    block_q = max(1, tiling.rows // group_pad)
    q_tiles = triton.cdiv(max_query_len, block_q)
    splits = 1
    if max_query_len == 1:
        splits = max(1, min(triton.cdiv(max_seq_len, MIN_SPLIT_KEYS), TARGET_PROGRAMS // seqs))
    part_out = part_stats = out  # unused when the kernel writes the output directly
    if splits > 1:
        if workspace is None:
            workspace = decode_workspace(splits * rows, group, geom.head_size, query.device)
        part_out = workspace[0][: splits * rows].view(splits, rows, group_pad, head_pad)
        part_stats = workspace[1][: splits * rows].view(splits, rows, group_pad, 2)
    low_precision = dot_in_cache_dtype(cache)
    _paged_attention_kernel[(seqs, q_tiles, splits)](
        query,
        out,
        cache,
        part_out,
        part_stats,
        token_of,
        head_of,
        query_start_loc,
        seq_lens,
        page_table,
        *query.stride(),
        *out.stride(),
        page_table.stride(0),
        scale * math.log2(math.e),
        group,
        rows,
        splits,
        *geom.addressing(),
        HEAD_SIZE=geom.head_size,
        BLOCK_Q=block_q,
        GROUP_PAD=group_pad,
        HEAD_PAD=head_pad,
        BLOCK_N=tiling.block_n,
        SPLIT=splits > 1,
        LOW_PRECISION=low_precision,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(rows,)](
            out,
            part_out,
            part_stats,
            token_of,
            head_of,
            *out.stride(),
            group,
            geom.head_size,
            rows,
            splits,
            GROUP_PAD=group_pad,
            HEAD_PAD=head_pad,
        )


def paged_attention_reference(
    query, out, cache, geom, token_of, head_of, query_start_loc, seq_lens, page_table, scale, num_kv_heads
) -> None:
    """Plain torch, one virtual token at a time: softmax(q K^T * scale) V over the keys at positions <= its own."""
    group = query.shape[1] // num_kv_heads
    storage = flat(cache)
    starts = query_start_loc.tolist()
    for seq in range(len(starts) - 1):
        first, end = starts[seq], starts[seq + 1]
        for i in range(first, end):
            position = int(seq_lens[seq]) - (end - first) + (i - first)
            keys_at = torch.arange(position + 1, device=cache.device)
            slots = page_table[seq].long()[keys_at // geom.block_size] * geom.block_size + keys_at % geom.block_size
            k = storage[geom.element_index(slots)].float()
            v = storage[geom.element_index(slots, value=True)].float()
            heads = slice(int(head_of[i]) * group, (int(head_of[i]) + 1) * group)
            q = query[int(token_of[i]), heads].float()
            weights = torch.softmax(q @ k.T * scale, dim=-1)
            out[int(token_of[i]), heads] = (weights @ v).to(out.dtype)
