"""H2O heavy hitters: accumulated attention, plus a recent window, kept as the request generates.

A token's score is the attention every query that has seen it paid it; a head keeps its most recent
tokens and the best-scored older ones, and in decode adds each new token's attention and evicts back to
the budget once a page's worth is over it, so whole pages are freed. The readings we chose, and how the
engine supplies the column sums: docs/policies.md#h2o.

Paper: *H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models*,
arXiv:2306.14048 (the baseline of KeyDiff, arXiv:2504.15364, and D2O, arXiv:2406.13035). Parameters:
``recent_fraction`` (1/2).
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

    reads = Inputs(attention=True, new_token_attention=True)
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
