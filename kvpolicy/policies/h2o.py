"""H2O heavy hitters: accumulated attention over the whole prompt, plus a recent window.

The baseline named in keydiff.txt and d2o.txt (Zhang et al., 2024). Readings
we chose:

- Accumulated score of a token: the sum, over every prompt query, of its
  causal softmax attention weight (the column sums of the prompt's attention
  matrix), per query head, in float64 (so near-ties order the same in the
  policy and its reference). GQA: the query heads sharing a KV head are
  averaged, as keydiff.txt (App. B.2) does for its H2O baseline.
- ``budget`` counts every token a head keeps: the last ``recent_tokens``
  (at most ``budget``) are always kept, and the ``budget - recent`` best
  scores among the older tokens (ties to the earlier position).
- Decode: the new token's attention weights are added to the scores (its own
  score starts at its own weight); over budget, the older-than-recent token
  with the lowest score is evicted (ties to the later one, so that a step
  evicts exactly what keeping the top scores would).

In the engine, H2O runs at prompt end: the backend stashes every prompt
query of each layer while the prompt is read (as it stashes the observation
window for SnapKV) and hands them over with the keys. The decode step is not
wired yet: the fused attention kernel returns no weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpolicy.policies.base import Policy, PromptKV


def attention_column_sums(keys: torch.Tensor, queries: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Column sums of each query head's causal prompt attention, [q_heads, prompt_len], float64.

    ``keys``: [kv_heads, L, D]; ``queries``: [q_heads, L, D], query i at
    position i (query head q belongs to KV head ``q // (q_heads // kv_heads)``).
    Queries are taken ``chunk`` at a time so memory stays O(chunk * L).
    """
    kv_heads, length, dim = keys.shape
    q_heads = queries.shape[0]
    expanded = keys.double().repeat_interleave(q_heads // kv_heads, dim=0)
    sums = torch.zeros(q_heads, length, dtype=torch.float64)
    for start in range(0, length, chunk):
        rows = queries[:, start : start + chunk].double()
        end = start + rows.shape[1]  # keys past the chunk's last query get no weight: left out
        logits = torch.einsum("hqd,hld->hql", rows, expanded[:, :end]) / math.sqrt(dim)
        future = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
        sums[:, :end] += logits.masked_fill(future, float("-inf")).softmax(dim=-1).sum(dim=1)
    return sums


def group_mean(column_sums: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """H2O scores per KV head, [kv_heads, prompt_len]: query heads' column sums averaged over the GQA group."""
    return column_sums.view(kv_heads, -1, column_sums.shape[-1]).mean(dim=1)


def accumulated_attention(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """H2O scores per KV head, [kv_heads, prompt_len]."""
    return group_mean(attention_column_sums(keys, queries), keys.shape[0])


def heavy_hitters(scores: torch.Tensor, budget: int, recent: int, sinks: int = 0) -> torch.Tensor:
    """Kept positions per head, [kv_heads, budget], ascending: first ``sinks``, last ``recent``, best scores between."""
    heads, length = scores.shape
    ranked = scores[:, sinks : length - recent].argsort(dim=-1, descending=True, stable=True)
    best = ranked[:, : budget - recent - sinks] + sinks
    fixed = torch.cat([torch.arange(sinks), torch.arange(length - recent, length)]).expand(heads, -1)
    return torch.cat([best, fixed], dim=1).sort(dim=-1).values


def h2o_decode_step(
    scores: torch.Tensor, new_weights: torch.Tensor, budget: int, recent_tokens: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step of one layer: accumulate the new token's attention, evict one token if over budget.

    ``scores``: [kv_heads, n], the accumulated scores of the cached tokens in
    cache (= position) order; ``new_weights``: [q_heads, n + 1], the new
    token's attention over the cache and itself. Returns the updated scores
    of the tokens that stay, [kv_heads, n + 1] or [kv_heads, n], and the cache
    slot each head evicts ([kv_heads]), or None while within budget.
    """
    kv_heads, cached = scores.shape
    added = new_weights.double().view(kv_heads, -1, cached + 1).mean(dim=1)
    updated = torch.cat([scores.double(), torch.zeros(kv_heads, 1, dtype=torch.float64)], dim=1) + added
    if cached + 1 <= budget:
        return updated, None
    older = updated[:, : cached + 1 - min(recent_tokens, budget)]
    evicted = older.shape[1] - 1 - older.flip(-1).argmin(dim=-1)
    stays = torch.ones_like(updated, dtype=torch.bool).scatter(1, evicted[:, None], False)
    return updated[stays].view(kv_heads, cached), evicted


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy hitters by accumulated attention over every prompt query, plus the recent tokens."""

    name = "h2o"
    relocates = True
    needs_queries = True
    recent_tokens: int = 64

    def keep(self, prompt: PromptKV, budget: int) -> list[torch.Tensor]:
        if prompt.num_tokens <= budget:
            return self.keep_all(prompt)
        scores = accumulated_attention(prompt.keys, prompt.queries)
        return list(heavy_hitters(scores, budget, min(self.recent_tokens, budget)).unbind(0))
