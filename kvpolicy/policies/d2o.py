"""D2O (arXiv:2406.13035): layer budgets from attention variance; H2O eviction with sinks; evicted tokens merged back.

Readings we chose (the paper's equations did not survive text extraction;
the prose of §4, Table 4, §5.1 and App. A.3 settles them):

- Layer density (§4.1, eq. 4): per query head, the column sums of the causal
  softmax attention of every prompt query (the "cumulative attention
  sequence"); its population variance over positions; averaged over the
  layer's query heads.
- Layer budgets (eq. 5, Table 4 "inverse variance softmax"): layer l gets
  ``layers * budget * softmax_l(1 / var_l)`` tokens per KV head, rounded by
  largest remainder (floors, then one more token to the largest fractional
  parts, ties to the lower layer), so the total is exactly
  ``layers * budget``. A layer whose budget reaches its prompt length keeps
  the prompt whole; its surplus is not handed to other layers.
- Eviction (§4.2.1, eq. 6-8): H2O accumulated attention (GQA: mean over the
  group), the first ``sink_tokens`` and the last ``floor(budget *
  recent_fraction)`` tokens always kept; ``recent_fraction`` = 1/4 from
  N:M = 3:1 (§5.1, A.3). Sinks and recent tokens both count in ``budget``.
- Matching (eq. 9): each evicted key's cosine similarity to every kept key
  of its KV head (sinks, heavy hitters and recent tokens alike); its nearest
  kept key (ties to the earlier one).
- EMA threshold (eq. 10), one per KV head: at the prompt, the mean over the
  evicted tokens of their best similarity; at each later eviction,
  ``beta * mean(best similarities of this step) + (1 - beta) * previous``,
  beta = 0.7 (A.3). The threshold is updated first; an evicted token is then
  merged if its best similarity reaches it, and discarded otherwise.
- Weighted merge (eq. 11-12, GAT-style): a kept token j and the evicted
  tokens merged into it are averaged with weights ``exp(similarity)``, j's
  own similarity being 1: ``k_j <- (e*k_j + sum_i exp(u_ij) k_i) / (e + sum_i
  exp(u_ij))``; values take the same weights (§4.2.2: similarity on keys only,
  shared with values). Computed in float64, returned in the input dtype.

Decode follows H2O's (h2o.py): generated tokens' attention is added to the
scores and, once a page's worth of tokens is over a layer's budget, that
layer evicts back to it (sinks, recent quarter, heavy hitters) and merges
the evicted tokens against the carried threshold. Every layer keeps the
budget it got at prompt end.

In the engine: every layer's column sums are taken as the layer runs
(``observe``), the layer budgets once the last layer has run, and then each
layer is compressed and its merged K/V written into its pages; in decode
the backend adds attention weights and runs the eviction passes as for H2O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpolicy.policies.base import CompressedKV, Mode, Policy, PromptKV
from kvpolicy.policies.h2o import attention_column_sums, group_mean, heavy_hitters, prompt_column_sums


def prompt_attention_variance(keys: torch.Tensor, queries: torch.Tensor) -> float:
    """A layer's attention density (eq. 4): variance of each query head's column sums, averaged over heads."""
    return column_sums_variance(attention_column_sums(keys, queries)).item()


def column_sums_variance(column_sums: torch.Tensor) -> torch.Tensor:
    """``prompt_attention_variance`` from the column sums, a 0-dim float64 tensor where they are."""
    return column_sums.var(dim=-1, correction=0).mean()


def layer_budgets(variances: Sequence[float] | torch.Tensor, budget: int) -> list[int]:
    """Tokens per KV head for each layer (eq. 5): inverse-variance softmax of ``layers * budget``.

    ``variances``: one per layer, floats or a float64 tensor on any device; the budgets come back to
    the host once (the page tables are sized by them)."""
    if not isinstance(variances, torch.Tensor):
        variances = torch.tensor(variances, dtype=torch.float64)
    shares = torch.softmax(1 / variances.double(), dim=0)
    total = len(variances) * budget
    exact = shares * total
    counts = exact.floor()
    by_remainder = (counts - exact).argsort(stable=True)
    rank = torch.empty_like(by_remainder)
    rank[by_remainder] = torch.arange(rank.numel(), device=rank.device)
    counts += (rank < total - counts.sum()).to(counts.dtype)
    return counts.long().tolist()


def merge_evicted(
    kept_keys: torch.Tensor,
    kept_values: torch.Tensor,
    evicted_keys: torch.Tensor,
    evicted_values: torch.Tensor,
    threshold: torch.Tensor | None,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Merge evicted tokens into their nearest kept tokens when similar enough (eq. 9-12).

    Keys and values: [kv_heads, n, D] (kept) and [kv_heads, m, D] (evicted).
    ``threshold``: [kv_heads], the EMA threshold of earlier steps, None at the
    prompt. Returns the kept keys and values after merging and the updated
    threshold. Serves the prompt (many evicted) and decode (one per step).
    """
    if evicted_keys.shape[1] == 0:
        return kept_keys, kept_values, threshold
    unit_evicted, unit_kept = (F.normalize(k.double(), dim=-1) for k in (evicted_keys, kept_keys))
    similarity = unit_evicted @ unit_kept.transpose(1, 2)
    best, nearest = similarity.max(dim=-1)
    step = best.mean(dim=-1)
    threshold = step if threshold is None else beta * step + (1 - beta) * threshold
    weight = torch.where(best >= threshold[:, None], best.exp(), 0.0)
    norm = torch.full(kept_keys.shape[:2], math.e, dtype=torch.float64, device=weight.device)
    norm = norm.scatter_add(1, nearest, weight)

    def fuse(kept: torch.Tensor, evicted: torch.Tensor) -> torch.Tensor:
        target = nearest[..., None].expand(-1, -1, evicted.shape[-1])
        summed = (math.e * kept.double()).scatter_add(1, target, weight[..., None] * evicted.double())
        return (summed / norm[..., None]).to(kept.dtype)

    return fuse(kept_keys, evicted_keys), fuse(kept_values, evicted_values), threshold


def _gather(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return tensor.gather(1, positions[..., None].expand(-1, -1, tensor.shape[-1]))


@dataclass(frozen=True)
class D2O(Policy):
    """D2O over a layer's prompt or its cache in decode; ``budget`` is the layer's, from ``layer_budgets``.

    ``merge=False`` (``--kv-merge false``) evicts without merging: the paper's
    ablation of merging against pure eviction at the same budgets.
    """

    name = "d2o"
    mode = Mode.RELOCATE
    needs_queries = True
    budgets_across_layers = True
    evicts_in_decode = True
    accumulates_attention = True
    sink_tokens: int = 4
    recent_fraction: float = 0.25
    beta: float = 0.7
    merge: bool = True

    def keep(self, prompt: PromptKV, budget: int) -> list[torch.Tensor]:
        return self.compress(prompt, budget).kept

    def observe(self, prompt: PromptKV) -> torch.Tensor:
        """The layer's attention column sums, [q_heads, prompt_len]: its variance and its H2O scores."""
        return prompt_column_sums(prompt)

    def layer_budgets(self, observations: list[torch.Tensor], budget: int) -> list[int]:
        return layer_budgets(torch.stack([column_sums_variance(sums) for sums in observations]), budget)

    def compress(self, prompt: PromptKV, budget: int, observation: torch.Tensor | None = None) -> CompressedKV:
        scores = prompt.scores
        if scores is None:
            scores = group_mean(self.observe(prompt) if observation is None else observation, prompt.num_heads)
        if prompt.num_tokens <= budget:
            return CompressedKV(self.keep_all(prompt), scores=scores, threshold=prompt.threshold)
        recent = int(budget * self.recent_fraction)
        sinks = min(self.sink_tokens, budget - recent)
        kept = heavy_hitters(scores, budget, recent, sinks)
        kept_scores = scores.gather(1, kept)
        if not self.merge:
            return CompressedKV(list(kept.unbind(0)), scores=kept_scores)
        # Every head drops the same count: its positions, ascending, without a boolean mask (a host sync).
        dropped = torch.ones_like(scores, dtype=torch.uint8).scatter(1, kept, 0)
        evicted = dropped.argsort(dim=-1, descending=True, stable=True)[:, : scores.shape[1] - kept.shape[1]]
        keys, values, threshold = merge_evicted(
            _gather(prompt.keys, kept),
            _gather(prompt.values, kept),
            _gather(prompt.keys, evicted),
            _gather(prompt.values, evicted),
            prompt.threshold,
            self.beta,
        )
        return CompressedKV(list(kept.unbind(0)), keys, values, kept_scores, threshold)
