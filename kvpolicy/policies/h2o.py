"""H2O heavy hitters: accumulated attention, plus a recent window, kept as the request generates.

The baseline named in KeyDiff (arXiv:2504.15364) and D2O (arXiv:2406.13035); H2O itself is
Zhang et al., arXiv:2306.14048. Readings
we chose:

- Accumulated score of a token: the sum, over every query that has seen it,
  of its causal softmax attention weight (at prompt end, the column sums of
  the prompt's attention matrix), per query head. Logits and softmax in
  float32, sums in float64. GQA: the query heads sharing a KV head are
  averaged, as the KeyDiff paper (App. B.2) does for its H2O baseline.
- ``budget`` counts every token a head keeps: the last ``floor(budget *
  recent_fraction)`` are always kept, and the rest of the budget goes to the
  best scores among the older tokens (ties to the earlier position).
  ``recent_fraction`` = 1/2: H2O's experiments give heavy hitters and recent
  tokens equal budgets (its code's ``heavy_ratio`` = ``recent_ratio``).
- Scores are plain sums, not divided by the number of queries that saw a
  token: the paper's score is the accumulated attention, and the division
  is commented out in its code.
- Decode, at page granularity: each new token's attention weights over the
  cache are added to the scores (its own score starts at its own weight).
  The paper evicts the lightest older token at every step; we evict once a
  page's worth of tokens (``block_size``) is over budget, keeping the same
  rule (recent tokens plus the best scores), so a head attends over
  ``budget`` to ``budget + block_size`` tokens and pages are freed
  whole. A token that one-step eviction would drop may survive until the
  page fills and be judged again then.

In the engine, the backend hands over the prompt's column sums (on CPU it
attends each prompt chunk itself and sums its queries' weights from the same
products) or, where it cannot, every prompt query of each layer, stashed
while the prompt is read; it compresses at prompt end. In decode the fused attention kernel returns no
weights, so the backend recomputes the new token's weights over the
budget-sized cache it just attended (``new_token_attention``: one batched
product per layer over every relocated request and head) and the builder
schedules an eviction pass whenever a page's worth is over budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpolicy.policies.base import Inputs, PromptKV
from kvpolicy.policies.compose import Scorer, Split, compose
from kvpolicy.policies.options import option, unit_interval


def attention_column_sums(keys: torch.Tensor, queries: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Column sums of each query head's causal attention over ``keys``, [q_heads, length], float64.

    ``keys``: [kv_heads, length, D]; ``queries``: [q_heads, t, D], the last
    ``t`` positions (query i at position ``length - t + i``): the whole prompt
    at prompt end, the new tokens in decode. Query head q belongs to KV head
    ``q // (q_heads // kv_heads)``. Queries are taken ``chunk`` at a time so
    memory stays O(chunk * length).
    """
    kv_heads, length, dim = keys.shape
    q_heads, count = queries.shape[:2]
    expanded = keys.float().repeat_interleave(q_heads // kv_heads, dim=0).transpose(1, 2)
    sums = torch.zeros(q_heads, length, dtype=torch.float64, device=keys.device)
    first = length - count
    for start in range(0, count, chunk):
        rows = queries[:, start : start + chunk].float() / math.sqrt(dim)
        end = first + start + rows.shape[1]  # keys past the chunk's last query get no weight: left out
        positions = torch.arange(end, device=keys.device)
        future = positions[None, :] > positions[first + start :, None]
        weights = (rows @ expanded[..., :end]).masked_fill_(future, float("-inf")).softmax(dim=-1)
        sums[:, :end] += weights.sum(dim=1, dtype=torch.float64)
    return sums


def group_mean(column_sums: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """H2O scores per KV head, [kv_heads, length]: query heads' column sums averaged over the GQA group."""
    return column_sums.view(kv_heads, -1, column_sums.shape[-1]).mean(dim=1)


def prompt_column_sums(prompt: PromptKV) -> torch.Tensor:
    """The prompt's attention column sums, [q_heads, n]: the backend's if it computed them, else torch's."""
    if prompt.column_sums is not None:
        return prompt.column_sums
    return attention_column_sums(prompt.keys, prompt.queries)


def new_token_attention(keys: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Each sequence's newest token's attention over it, its query heads averaged, [seqs, n] float64.

    A sequence is one KV head of one request. ``keys``: [seqs, n, D], the
    first ``lengths[s]`` valid, the new token's last (zero weight past the
    length); ``queries``: [seqs, group, D], the new token's query heads.
    """
    logits = queries.float() @ keys.float().transpose(1, 2) / math.sqrt(keys.shape[-1])
    padding = torch.arange(keys.shape[1], device=keys.device) >= lengths[:, None]
    return logits.masked_fill_(padding[:, None, :], float("-inf")).softmax(dim=-1).mean(dim=1, dtype=torch.float64)


def add_new_token(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scores [kv_heads, n] after a new token attended with ``weights`` [kv_heads, n + 1]; it starts at its own."""
    fresh = torch.zeros(scores.shape[0], 1, dtype=torch.float64, device=scores.device)
    return torch.cat([scores, fresh], dim=1) + weights


@dataclass(frozen=True)
class AccumulatedAttention(Scorer):
    """A token's score: the attention every query gave it, the prompt's (its column sums, the GQA group
    averaged) and, carried into decode, each generated token's."""

    reads = Inputs(attention=True)
    carries_scores = True

    def observe(self, prompt: PromptKV) -> torch.Tensor:
        """The layer's attention column sums, [q_heads, prompt_len]."""
        return prompt_column_sums(prompt)

    def scores(self, prompt: PromptKV, observation: torch.Tensor | None = None) -> torch.Tensor:
        if prompt.scores is not None:
            return prompt.scores
        return group_mean(self.observe(prompt) if observation is None else observation, prompt.num_heads)


@dataclass(frozen=True)
class HeavyHitters(AccumulatedAttention):
    """H2O: a share of the budget to the most recent tokens, the rest to the best accumulated attention."""

    recent_fraction: float = option(
        0.5, "the budget's share kept for the most recent tokens", check=unit_interval, strict=False
    )

    def split(self, prompt: PromptKV, budget: int) -> Split:
        recent = int(budget * self.recent_fraction)
        return Split(0, recent, recent)


H2O = compose(
    "h2o",
    HeavyHitters(),
    in_decode=True,
    class_name="H2O",
    module=__name__,
    doc="H2O: heavy hitters by accumulated attention (the prompt's, then each generated token's) and the recent tokens.",
)
