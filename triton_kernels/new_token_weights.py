"""H2O's decode-time accumulation: each new token's attention weights over its KV head's paged keys.

The fused attention kernel returns no weights, so they are recomputed from
the pages in place (``group_logits``) and averaged over the query heads of
the KV head.
"""

from __future__ import annotations

import torch

from .geometry import PageGeometry, flat
from .group_logits import group_logits


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
    group = query.shape[1] // num_kv_heads
    logits = group_logits(query, cache, geom, token_of, head_of, page_table, seq_lens, scale, group)
    return logits.softmax(dim=-1).mean(dim=1)


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
