"""kvpolicy's C++ CPU ops (``csrc/``). Each takes the arguments of its ``kvpolicy_triton`` twin
(a cache addressed through a ``PageGeometry``), so both are tested against the same plain-torch
references; parallel over torch's threads (``at::parallel_for``)."""

from __future__ import annotations

import math

import torch

from kvpolicy_csrc import _C


def attention_column_sums(keys: torch.Tensor, queries: torch.Tensor, scale: float) -> torch.Tensor:
    """Column sums of each query head's causal softmax attention over ``keys``, [q_heads, length] float64.

    ``keys`` [kv_heads, length, dim]; ``queries`` [q_heads, count, dim], the last ``count``
    positions. Reference: ``kvpolicy.policies.h2o.attention_column_sums``.
    """
    return _C.attention_column_sums(keys, queries, scale)


def prompt_attention(
    keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the last ``count`` positions and its column sums, from one QK^T.

    ``keys``, ``values`` [kv_heads, length, dim]; ``queries`` [q_heads, count, dim]. Returns the
    output [q_heads, count, dim] float32 and ``attention_column_sums(keys, queries, scale)``.
    """
    out, sums = _C.prompt_attention(keys, values, queries, scale)
    return out, sums


def new_token_weights(query, cache, geom, token_of, head_of, page_table, seq_lens, scale, num_kv_heads) -> torch.Tensor:
    """Per sequence, its new token's softmax weights over its pages, its query heads averaged,
    [sequences, pages * block_size] float32. Reference: ``kvpolicy_triton.new_token_weights_reference``."""
    return _C.new_token_weights(
        query, cache, list(geom.key_addressing()), token_of, head_of, page_table, seq_lens, scale, num_kv_heads
    )


def context_page_scores(query, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """OmniKV's page scores: per row, each page's sum over its tokens of the max over query heads of
    the row's query's softmax weights, [rows, pages] float64. Reference:
    ``kvpolicy_triton.context_page_scores_reference``."""
    return _C.context_page_scores(query, cache, list(geom.key_addressing()), token_idx, page_ids, lengths, scale)


def context_attention(query, out, cache, geom, token_idx, page_ids, lengths, scale) -> torch.Tensor:
    """``context_page_scores`` of the rows, and their attention output written into ``out`` [T, Hq, D] (rows
    ``token_idx``) from the same softmax weights: a filter layer's keys read once for both. Reference:
    ``kvpolicy_triton.context_attention_reference``."""
    return _C.context_attention(query, out, cache, list(geom.addressing()), token_idx, page_ids, lengths, scale)


def gather_tokens(cache, geom, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows [n, head_size] of the tokens at ``slots``. Reference: ``kvpolicy_triton.gather_tokens_reference``."""
    keys, values = _C.gather_tokens(cache, list(geom.addressing()), geom.head_size, slots)
    return keys, values


def gather_values(cache, geom, slots) -> torch.Tensor:
    """V rows [n, head_size] of the tokens at ``slots``, their K left unread.
    Reference: ``kvpolicy_triton.gather_values_reference``."""
    return _C.gather_values(cache, list(geom.addressing()), geom.head_size, slots)


def scatter_tokens(cache, geom, slots, keys, values) -> None:
    """Write K and V rows at ``slots``, in place. Reference: ``kvpolicy_triton.scatter_tokens_reference``."""
    _C.scatter_tokens(cache, list(geom.addressing()), geom.head_size, slots, keys, values)


def move_tokens(cache, geom, src, dst) -> None:
    """Every token at ``src[i]`` to ``dst[i]``, all read before any write (overlap-safe).
    Reference: ``kvpolicy_triton.move_tokens_reference``."""
    _C.move_tokens(cache, list(geom.addressing()), geom.head_size, src, dst)


def pod_attention(
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
    """PoD's decode attention (eq. 3-4) into ``out``; [S, G] bool, the query heads whose distant part ``tau``
    skipped. Reference: ``kvpolicy_triton.pod_attention_reference``."""
    return _C.pod_attention(
        query,
        out,
        cache,
        list(geom.addressing()),
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
        math.inf if tau is None else float(tau),
    )
