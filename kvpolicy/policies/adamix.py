"""Ada-Mix (ours): Ada-KV's head-adaptive allocation over observation-window and KeyDiff rankings combined.

On the default model KeyDiff's attention-free scores keep needles the observation window misses; both scores
become ranks over the layer, so neither scale dominates and Ada-KV still moves budget between heads, and a
token either ranking puts high is kept. Chosen on tuning prompts by the quality harness: docs/policies.md.

Papers: *Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference*,
arXiv:2407.11550; *KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments*, arXiv:2504.15364. Parameters: ``combine`` (union, or blend by ``mix``,
0.5), ``window`` (16), ``pool_kernel`` (15), ``pool_shift`` (4), ``group_scores`` (max), ``alpha`` (0.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.policies.base import PromptKV
from kvpolicy.policies.compose import compose
from kvpolicy.policies.keydiff import keydiff_scores
from kvpolicy.policies.options import one_of, option, unit_interval
from kvpolicy.policies.snapkv import AdaKV, ObservationWindow


def layer_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each score's rank among all of the layer's scores, in [0, 1], 1 the best (ties: lower head, then earlier position, higher)."""
    flat = scores.reshape(-1)
    order = flat.argsort(descending=True, stable=True)
    ranks = torch.empty(flat.numel(), dtype=torch.float64, device=flat.device)
    descending = torch.arange(flat.numel() - 1, -1, -1, dtype=torch.float64, device=flat.device)
    ranks[order] = descending / max(flat.numel() - 1, 1)
    return ranks.view_as(scores)


@dataclass(frozen=True)
class MixedScores(ObservationWindow):
    """The observation window's and KeyDiff's layer-wide ranks, combined: their union (a token's better
    rank) or a blend (``mix`` the KeyDiff share)."""

    mix: float = option(
        0.5, "KeyDiff's share of the blended scores (0: the window's, 1: KeyDiff's)", check=unit_interval
    )
    combine: str = option(
        "union",
        "union (a token's better rank of the two: kept if either score keeps it) or blend (the ranks weighted by --kv-mix)",
        check=one_of("blend", "union"),
    )

    def scores(self, prompt: PromptKV, observation=None) -> torch.Tensor:
        window = super().scores(prompt)
        if self.combine == "blend" and self.mix == 0:
            return window
        # Ranks over every head of the layer, even when tensor parallelism split them.
        window = prompt.across_heads(window)
        prefix = layer_ranks(prompt.across_heads(keydiff_scores(prompt.keys)[:, : window.shape[1]]))
        if self.combine == "union":
            return prompt.local(torch.maximum(layer_ranks(window), prefix))
        return prompt.local((1 - self.mix) * layer_ranks(window) + self.mix * prefix)


AdaMix = compose(
    "adamix",
    MixedScores(window=16, pool_kernel=15, pool_shift=4, group_scores="max"),
    heads=AdaKV(),
    class_name="AdaMix",
    module=__name__,
    doc="Ada-Mix: Ada-KV's allocation over the window's and KeyDiff's ranks combined.",
)
