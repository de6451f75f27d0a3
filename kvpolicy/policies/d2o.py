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

from kvpolicy.policies.base import CompressedKV, PromptKV
from kvpolicy.policies.compose import LayerAllocator, Rewrite, Split, compose
from kvpolicy.policies.h2o import HeavyHitters, attention_column_sums
from kvpolicy.policies.options import not_negative, option, unit_interval


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
class HeavyHittersWithSinks(HeavyHitters):
    """D2O's eviction: H2O's with the first tokens kept as attention sinks and a quarter of the budget
    recent (N:M = 3:1)."""

    recent_fraction: float = option(
        0.25, "the budget's share kept for the most recent tokens", check=unit_interval, strict=False
    )
    sink_tokens: int = option(4, "attention-sink tokens always kept", check=not_negative, strict=False)

    def split(self, prompt: PromptKV, budget: int) -> Split:
        recent = super().split(prompt, budget).recent
        sinks = min(self.sink_tokens, budget - recent)
        return Split(sinks, recent, sinks + recent)


@dataclass(frozen=True)
class InverseVarianceBudgets(LayerAllocator):
    """D2O's layer budgets: the inverse-variance softmax of every layer's attention column sums."""

    across_layers = True

    def layer_budgets(self, observations: list[torch.Tensor], budget: int) -> list[int]:
        return layer_budgets(torch.stack([column_sums_variance(sums) for sums in observations]), budget)


@dataclass(frozen=True)
class MergeEvicted(Rewrite):
    """D2O's merge: each evicted token into its nearest kept key when similar enough (an EMA threshold)."""

    beta: float = option(0.7, "D2O: the EMA weight of this eviction's similarities in the threshold", flag=None)
    merge: bool = option(True, "merge evicted tokens into their nearest kept ones (false: evict only)")

    def apply(self, prompt: PromptKV, kept: list[torch.Tensor], scores: torch.Tensor | None) -> CompressedKV:
        if not self.merge:
            return CompressedKV(kept, scores=scores)
        chosen = torch.stack(kept)
        # Every head drops the same count: its positions, ascending, without a boolean mask (a host sync).
        dropped = torch.ones(prompt.num_heads, prompt.num_tokens, dtype=torch.uint8, device=chosen.device)
        dropped = dropped.scatter(1, chosen, 0)
        evicted = dropped.argsort(dim=-1, descending=True, stable=True)[:, : prompt.num_tokens - chosen.shape[1]]
        keys, values, threshold = merge_evicted(
            _gather(prompt.keys, chosen),
            _gather(prompt.values, chosen),
            _gather(prompt.keys, evicted),
            _gather(prompt.values, evicted),
            prompt.threshold,
            self.beta,
        )
        return CompressedKV(kept, keys, values, scores, threshold)


D2O = compose(
    "d2o",
    HeavyHittersWithSinks(),
    layers=InverseVarianceBudgets(),
    rewrite=MergeEvicted(),
    in_decode=True,
    class_name="D2O",
    module=__name__,
    doc="D2O: layer budgets from attention variance, H2O eviction with sinks, evicted tokens merged back "
    "(``merge=False``, ``--kv-merge false``: the paper's ablation, eviction alone).",
)
