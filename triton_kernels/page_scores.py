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
    group = query.shape[1] // kv_heads
    logits = group_logits(
        query,
        cache,
        geom,
        token_idx.repeat_interleave(kv_heads),
        torch.arange(kv_heads, device=query.device).repeat(rows),
        page_ids.reshape(rows * kv_heads, pages),
        lengths.repeat_interleave(kv_heads),
        scale,
        group,
    )
    return logits.softmax(dim=-1).view(rows, kv_heads * group, -1).amax(dim=1)


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


def context_page_scores(query, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """[B, P] float64: per row, each page's summed ``context_token_scores`` (same arguments; 0 past its length)."""
    rows, _, pages = page_ids.shape
    scores = context_token_scores(query, cache, geom, token_idx, page_ids, lengths, scale)
    return scores.double().view(rows, pages, geom.block_size).sum(dim=-1)


def context_page_scores_reference(query, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """Plain torch: ``context_token_scores_reference`` summed page by page, in float64."""
    rows, _, pages = page_ids.shape
    scores = context_token_scores_reference(query, cache, geom, token_idx, page_ids, lengths, scale)
    return scores.double().view(rows, pages, geom.block_size).sum(dim=-1)


def context_attention(query, out, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """``context_page_scores`` (same arguments), and each row's attention over its pages written into
    ``out`` [T, Hq, D] at its token: ``paged_attention`` with one virtual sequence per (row, KV head)."""
    rows, kv_heads, pages = page_ids.shape
    device = query.device
    paged_attention(
        query,
        out,
        cache,
        geom,
        token_idx.repeat_interleave(kv_heads),
        torch.arange(kv_heads, device=device).repeat(rows),
        torch.arange(rows * kv_heads + 1, device=device, dtype=torch.int32),
        lengths.repeat_interleave(kv_heads),
        page_ids.reshape(rows * kv_heads, pages),
        scale,
        kv_heads,
    )
    return context_page_scores(query, cache, geom, token_idx, page_ids, lengths, scale)


def context_attention_reference(query, cache, geom, token_idx, page_ids, lengths, scale):
    """Plain torch, row by row and query head by query head: (each row's attention output [B, Hq, D]
    float32, ``context_page_scores_reference``)."""
    rows, kv_heads, _ = page_ids.shape
    group = query.shape[1] // kv_heads
    storage = flat(cache)
    out = torch.zeros(rows, query.shape[1], query.shape[2], device=query.device)
    for b in range(rows):
        n = int(lengths[b])
        positions = torch.arange(n, device=cache.device)
        for head in range(query.shape[1]):
            table = page_ids[b, head // group].long()
            slots = table[positions // geom.block_size] * geom.block_size + positions % geom.block_size
            keys = storage[geom.element_index(slots)].float()
            values = storage[geom.element_index(slots, value=True)].float()
            weights = torch.softmax(keys @ query[int(token_idx[b]), head].float() * scale, dim=0)
            out[b, head] = weights @ values
    return out, context_page_scores_reference(query, cache, geom, token_idx, page_ids, lengths, scale)
