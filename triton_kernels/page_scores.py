"""OmniKV filter-layer token and page scores read straight from the pages: eq. (3)-(4) with the "last" selector.

Each (row, KV head) is one sequence of ``group_logits``; the softmax over
each query head's logits, then the max over all query heads of the row
(whichever KV head they read), gives the row's scores: 0 past its length.
A page's score, what the selection ranks, is the sum of its tokens' scores.
``context_attention`` is the filter layer's attention and scores in one op: on
CPU the C++ op reads the keys once for both; here two kernels.
"""

from __future__ import annotations

import torch

from .geometry import PageGeometry, flat
from .group_logits import group_logits
from .paged_attention import paged_attention


def _head_sequences(token_idx: torch.Tensor, page_ids: torch.Tensor, lengths: torch.Tensor):
    """Each (row, KV head) as one sequence: (its query token, KV head, pages, length), row-major."""
    rows, kv_heads, pages = page_ids.shape
    heads = torch.arange(kv_heads, device=page_ids.device).repeat(rows)
    return (
        token_idx.repeat_interleave(kv_heads),
        heads,
        page_ids.reshape(rows * kv_heads, pages),
        lengths.repeat_interleave(kv_heads),
    )


def _page_sums(scores: torch.Tensor, geom: PageGeometry) -> torch.Tensor:
    """Token scores [B, P * block_size] summed page by page, [B, P] float64."""
    return scores.double().view(scores.shape[0], -1, geom.block_size).sum(dim=-1)


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
    rows, kv_heads, _ = page_ids.shape
    group = query.shape[1] // kv_heads
    token_of, head_of, table, seq_lens = _head_sequences(token_idx, page_ids, lengths)
    logits = group_logits(query, cache, geom, token_of, head_of, table, seq_lens, scale, group)
    return logits.softmax(dim=-1).view(rows, kv_heads * group, -1).amax(dim=1)


def _reference_weights(query, cache, geom, token_idx, page_ids, lengths, scale):
    """Plain torch, row by row and query head by query head: (row, query head, the slots of the row's
    tokens, softmax(q K^T * scale) over them)."""
    group = query.shape[1] // page_ids.shape[1]
    storage = flat(cache)
    for b in range(page_ids.shape[0]):
        positions = torch.arange(int(lengths[b]), device=cache.device)
        for head in range(query.shape[1]):
            table = page_ids[b, head // group].long()
            slots = table[positions // geom.block_size] * geom.block_size + positions % geom.block_size
            keys = storage[geom.element_index(slots)].float()
            yield b, head, slots, torch.softmax(keys @ query[int(token_idx[b]), head].float() * scale, dim=0)


def context_token_scores_reference(query, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """Plain torch: the running max over query heads of each row's softmax weights."""
    out = torch.zeros(page_ids.shape[0], page_ids.shape[2] * geom.block_size, device=query.device)
    for b, _, _, weights in _reference_weights(query, cache, geom, token_idx, page_ids, lengths, scale):
        out[b, : len(weights)] = torch.maximum(out[b, : len(weights)], weights)
    return out


def context_page_scores(query, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """[B, P] float64: per row, each page's summed ``context_token_scores`` (same arguments; 0 past its length)."""
    return _page_sums(context_token_scores(query, cache, geom, token_idx, page_ids, lengths, scale), geom)


def context_page_scores_reference(query, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """Plain torch: ``context_token_scores_reference`` summed page by page, in float64."""
    return _page_sums(context_token_scores_reference(query, cache, geom, token_idx, page_ids, lengths, scale), geom)


def context_attention(query, out, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """``context_page_scores`` (same arguments), and each row's attention over its pages written into
    ``out`` [T, Hq, D] at its token: ``paged_attention`` with one virtual sequence per (row, KV head)."""
    rows, kv_heads, _ = page_ids.shape
    token_of, head_of, table, seq_lens = _head_sequences(token_idx, page_ids, lengths)
    query_start_loc = torch.arange(rows * kv_heads + 1, device=query.device, dtype=torch.int32)
    paged_attention(query, out, cache, geom, token_of, head_of, query_start_loc, seq_lens, table, scale, kv_heads)
    return context_page_scores(query, cache, geom, token_idx, page_ids, lengths, scale)


def context_attention_reference(query, cache, geom, token_idx, page_ids, lengths, scale):
    """Plain torch, row by row and query head by query head: (each row's attention output [B, Hq, D]
    float32, ``context_page_scores_reference``)."""
    storage = flat(cache)
    attended = torch.zeros(page_ids.shape[0], *query.shape[1:], device=query.device)
    for b, head, slots, weights in _reference_weights(query, cache, geom, token_idx, page_ids, lengths, scale):
        attended[b, head] = weights @ storage[geom.element_index(slots, value=True)].float()
    return attended, context_page_scores_reference(query, cache, geom, token_idx, page_ids, lengths, scale)
