"""PoD's decode attention (eq. 3-4): one new token per sequence over its own pages, plus shared distant logits.

A sequence is one KV head of one decode row in one layer, attending with its G query heads over its own keys and values
(``page_table``, ``seq_lens``). One that keeps every key (a block's lowest layer) also stores its distant keys' logits,
positions ``[start, start + count)``, in row ``write_to`` of ``distant_logits``; one that shares (``read_from >= 0``)
attends to its ``count`` distant tokens with row ``read_from``'s logits and its own values, two per slot on
``value_table``'s pages, in one softmax over both groups (eq. 4's gate); a query head whose proximal share reaches
``tau`` skips the distant part (§2.3). One program per sequence: its own keys ``BLOCK_N`` at a time with an online
softmax, then the distant logits twice (maximum and sum, then the weighted values), so a decode reads each key and
value once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .addressing import dot_in_cache_dtype, kv_offsets, load_kv_rows, row_pointers, table_slots, tile_mask
from .attention_math import attend_step, key_logits, load_queries, softmax_step, weighted_values
from .geometry import PageGeometry, flat
from .launch import steady_jit

BLOCK_N = 64


@steady_jit
def _pod_attention_kernel(
    query_ptr,
    out_ptr,
    cache_ptr,
    logits_ptr,
    skipped_ptr,
    token_of_ptr,
    head_of_ptr,
    page_table_ptr,
    seq_lens_ptr,
    value_table_ptr,
    distant_start_ptr,
    distant_count_ptr,
    read_from_ptr,
    write_to_ptr,
    q_stride_t,
    q_stride_h,
    q_stride_d,
    o_stride_t,
    o_stride_h,
    o_stride_d,
    table_stride,
    value_table_stride,
    logits_stride_row,
    logits_stride_head,
    scale,
    tau,
    group,
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
    ROWS: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    token = tl.load(token_of_ptr + seq).to(tl.int64)
    rows = tl.arange(0, ROWS)
    head_ok = rows < group
    q_head = tl.load(head_of_ptr + seq).to(tl.int64) * group + rows
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = load_queries(
        query_ptr, cache_ptr, token, q_head, head_ok, dims, dim_ok, q_stride_t, q_stride_h, q_stride_d, LOW_PRECISION
    )
    length = tl.load(seq_lens_ptr + seq).to(tl.int64)
    start = tl.load(distant_start_ptr + seq).to(tl.int64)
    count = tl.load(distant_count_ptr + seq).to(tl.int64)
    read_from = tl.load(read_from_ptr + seq).to(tl.int64)
    write_to = tl.load(write_to_ptr + seq).to(tl.int64)

    # The own keys: online softmax (best, total, acc); a lowest layer also stores its distant logits.
    best = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_PAD), tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for key_start in range(0, length, BLOCK_N):
        j = key_start + keys
        key_ok = j < length
        slots = table_slots(page_table_ptr, seq, table_stride, j, key_ok, block_size)
        mask = tile_mask(key_ok, dim_ok, HEAD_SIZE, HEAD_PAD)
        k, v = load_kv_rows(
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
        )
        logits = key_logits(q, k, scale, LOW_PRECISION)
        if write_to >= 0:
            distant = key_ok & (j >= start) & (j < start + count)
            tl.store(
                logits_ptr + write_to * logits_stride_row + rows[:, None] * logits_stride_head + (j - start)[None, :],
                logits,
                mask=head_ok[:, None] & distant[None, :],
            )
        logits = tl.where(key_ok[None, :], logits, float("-inf"))
        best, total, acc = attend_step(best, total, acc, logits, v, EXP2=False, LOW_PRECISION=LOW_PRECISION)
    result = acc / total[:, None]
    skipped = rows < 0

    if (read_from >= 0) & (count > 0):
        shared = logits_ptr + read_from * logits_stride_row + rows[:, None] * logits_stride_head
        # The distant logits' maximum and sum first: the gate decides per head whether their values count.
        far_best = tl.full((ROWS,), float("-inf"), tl.float32)
        far_total = tl.zeros((ROWS,), tl.float32)
        for far_start in range(0, count, BLOCK_N):
            i = far_start + keys
            x = tl.load(shared + i[None, :], mask=head_ok[:, None] & (i < count)[None, :], other=float("-inf"))
            far_best, far_total, _, _ = softmax_step(far_best, far_total, x, EXP2=False)
        # Rows past G read no logit: a maximum of 0, not -inf, keeps their exp(x - far_best) 0 rather than NaN.
        far_best = tl.where(far_best == float("-inf"), 0.0, far_best)
        top = tl.maximum(best, far_best)
        near_mass = total * tl.exp(best - top)
        far_mass = far_total * tl.exp(far_best - top)
        skipped = head_ok & (near_mass / (near_mass + far_mass) >= tau)
        far_acc = tl.zeros((ROWS, HEAD_PAD), tl.float32)
        for far_start in range(0, count, BLOCK_N):
            i = far_start + keys
            far_ok = i < count
            x = tl.load(shared + i[None, :], mask=head_ok[:, None] & far_ok[None, :], other=float("-inf"))
            weights = tl.exp(x - far_best[:, None])
            pair = i // 2
            slots = table_slots(value_table_ptr, seq, value_table_stride, pair, far_ok, block_size)
            in_key_half, in_value_half = kv_offsets(
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
            )
            offsets = tl.where((i % 2 == 0)[:, None], in_key_half, in_value_half)
            v = tl.load(cache_ptr + offsets, mask=tile_mask(far_ok, dim_ok, HEAD_SIZE, HEAD_PAD), other=0.0)
            far_acc += weighted_values(weights, v, LOW_PRECISION)
        both = near_mass + far_mass
        joint = (acc * tl.exp(best - top)[:, None] + far_acc * tl.exp(far_best - top)[:, None]) / both[:, None]
        result = tl.where(skipped[:, None], result, joint)

    tl.store(
        row_pointers(out_ptr, token, q_head, dims, o_stride_t, o_stride_h, o_stride_d),
        result.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dim_ok[None, :],
    )
    tl.store(skipped_ptr + seq * group + rows, skipped.to(tl.int8), mask=head_ok)


def _never(tau: float | None) -> float:
    """``tau`` as the kernels take it: a gate is at most 1, so None (never skip) is infinity."""
    return math.inf if tau is None else float(tau)


def pod_attention(
    query: torch.Tensor,
    out: torch.Tensor,
    cache: torch.Tensor,
    geom: PageGeometry,
    token_of: torch.Tensor,
    head_of: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    value_table: torch.Tensor,
    distant_start: torch.Tensor,
    distant_count: torch.Tensor,
    read_from: torch.Tensor,
    write_to: torch.Tensor,
    distant_logits: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    tau: float | None = None,
) -> torch.Tensor:
    """Eq. 3-4 for sequences ``s`` (module docstring) into ``out`` [T, Hq, D]; returns [S, G] bool, the query heads
    whose distant part ``tau`` skipped.

    Sequence s is KV head ``head_of[s]`` of batch token ``token_of[s]`` (query [T, Hq, D]). ``distant_logits``
    [rows, G, N] float32 (contiguous in its last dim) is read at ``read_from[s]`` and written at
    ``write_to[s]`` (-1: neither); ``value_table`` [S, pages] is read only where ``read_from[s] >= 0``.
    """
    seqs = token_of.numel()
    group = query.shape[1] // num_kv_heads
    skipped = torch.zeros(seqs, group, dtype=torch.int8, device=query.device)
    if seqs == 0:
        return skipped.bool()
    _pod_attention_kernel[(seqs,)](
        query,
        out,
        cache,
        distant_logits,
        skipped,
        token_of,
        head_of,
        page_table,
        seq_lens,
        value_table,
        distant_start,
        distant_count,
        read_from,
        write_to,
        *query.stride(),
        *out.stride(),
        page_table.stride(0),
        value_table.stride(0),
        distant_logits.stride(0),
        distant_logits.stride(1),
        scale,
        _never(tau),
        group,
        *geom.addressing(),
        HEAD_SIZE=geom.head_size,
        ROWS=max(16, triton.next_power_of_2(group)),
        HEAD_PAD=max(16, triton.next_power_of_2(geom.head_size)),
        BLOCK_N=BLOCK_N,
        LOW_PRECISION=dot_in_cache_dtype(cache),
    )
    return skipped.bool()


def shared_attention_reference(query, keys, values, distant_logits, distant_values, scale, tau=None):
    """Eq. 3-4 for one decode query of one KV head: (output [G, D] float32, [G] bool, the heads whose distant
    part ``tau`` skipped).

    ``query`` [G, D] (the KV head's query heads); ``keys``/``values`` [m, D]: this layer's own tokens;
    ``distant_logits`` [G, n_d]: the lowest layer's scaled logits of the distant tokens, with
    ``distant_values`` [n_d, D] this layer's values of them; both None in a lowest layer. Eq. 4's gate
    makes eq. 3-4 one softmax over the concatenated logits, applied to this layer's values.
    """
    own = (query.float() @ keys.float().T) * scale
    proximal = own.softmax(dim=-1) @ values.float()
    if distant_logits is None:
        return proximal, torch.zeros(own.shape[0], dtype=torch.bool, device=own.device)
    both = torch.cat([own, distant_logits.float()], dim=-1)
    joint = both.softmax(dim=-1) @ torch.cat([values.float(), distant_values.float()])
    skipped = (own.logsumexp(dim=-1) - both.logsumexp(dim=-1)).exp() >= _never(tau)
    return torch.where(skipped[:, None], proximal, joint), skipped


def pod_attention_reference(
    query,
    out,
    cache,
    geom,
    token_of,
    head_of,
    page_table,
    seq_lens,
    value_table,
    distant_start,
    distant_count,
    read_from,
    write_to,
    distant_logits,
    scale,
    num_kv_heads,
    tau=None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time in order: ``shared_attention_reference`` over the sequence's rows."""
    storage = flat(cache)
    bs = geom.block_size
    group = query.shape[1] // num_kv_heads
    skipped = torch.zeros(token_of.numel(), group, dtype=torch.bool, device=query.device)

    def rows_at(table: torch.Tensor, n: int, value: bool) -> torch.Tensor:
        positions = torch.arange(n, device=table.device)
        slots = table.long()[positions // bs] * bs + positions % bs
        return storage[geom.element_index(slots, value)].float()

    for s in range(token_of.numel()):
        n, start, count = int(seq_lens[s]), int(distant_start[s]), int(distant_count[s])
        heads = slice(int(head_of[s]) * group, (int(head_of[s]) + 1) * group)
        q = query[int(token_of[s]), heads].float()
        keys, values = rows_at(page_table[s], n, False), rows_at(page_table[s], n, True)
        if int(write_to[s]) >= 0:
            distant_logits[int(write_to[s]), :, :count] = (q @ keys.T * scale)[:, start : start + count]
        far = far_values = None
        if int(read_from[s]) >= 0 and count:
            far = distant_logits[int(read_from[s]), :, :count]
            pairs = -(-count // 2)
            even, odd = rows_at(value_table[s], pairs, False), rows_at(value_table[s], pairs, True)
            far_values = torch.stack([even, odd], dim=1).flatten(0, 1)[:count]
        result, skipped[s] = shared_attention_reference(q, keys, values, far, far_values, scale, tau)
        out[int(token_of[s]), heads] = result.to(out.dtype)
    return skipped
