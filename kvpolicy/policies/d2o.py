"""D2O: layer budgets from attention variance, H2O eviction with sinks, evicted tokens merged back.

Each layer gets a share of ``layers * budget`` inverse to the variance of its prompt attention's column
sums; a head keeps sinks, a recent share and H2O's heavy hitters, and merges each evicted token into its
nearest kept key when their similarity reaches a per-head EMA threshold. Decode evicts a page at a time as
H2O does, against the carried scores and threshold. The readings we chose: docs/policies.md#d2o.

Paper: *D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large Language
Models*, arXiv:2406.13035. Parameters: ``sink_tokens`` (4), ``recent_fraction`` (1/4), ``beta`` (0.7),
``merge`` (true).
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
