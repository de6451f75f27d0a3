"""Ada-Heavy (ours): Ada-KV's head-adaptive allocation over the observation window's and H2O's rankings combined.

The observation window keeps what the question reads (a needle); it misses what the prompt itself kept
reading, such as the surname after each mention of a name, which a question about the most frequent name
needs: H2O's accumulated attention of every prompt query keeps it. H2O's scores are max-pooled as the
window's (SnapKV's clustering), so a heavy hitter keeps its neighbours. Both scores become ranks over the
layer and a token either puts high is kept, as in Ada-Mix, whose KeyDiff ranking this one replaces.
Every prompt query's attention is summed, so a prompt never starts from a prefix-cache hit. Chosen on
tuning prompts by the quality harness: docs/policies.md#ada-heavy-ours.

Papers: *Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference*,
arXiv:2407.11550; *H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models*,
arXiv:2306.14048. Parameters: ``window`` (16), ``pool_kernel`` (15), ``pool_shift`` (4), ``group_scores``
(max), ``pool_heavy`` (true), ``alpha`` (0.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.policies.adamix import layer_ranks
from kvpolicy.policies.base import Inputs, PromptKV
from kvpolicy.policies.compose import compose
from kvpolicy.policies.h2o import group_mean, prompt_column_sums
from kvpolicy.policies.options import option
from kvpolicy.policies.snapkv import AdaKV, ObservationWindow, shifted_max_pool


@dataclass(frozen=True)
class HeavyWindowScores(ObservationWindow):
    """The union of the observation window's and H2O's layer-wide ranks (a token's better rank of the two).

    The engine hands every prompt query's attention column sums (or the queries) and the window's queries;
    in a decode pass, the window's generated queries and their column sums."""

    reads = Inputs(window=True, attention=True)

    pool_heavy: bool = option(
        True, "max-pool H2O's scores as the window's, so a heavy hitter keeps its neighbours (false: unpooled)"
    )

    def scores(self, prompt: PromptKV, observation=None) -> torch.Tensor:
        window = prompt.across_heads(super().scores(prompt))
        heavy = group_mean(prompt_column_sums(prompt), prompt.num_heads)[:, : window.shape[1]]
        if self.pool_heavy:
            heavy = shifted_max_pool(heavy, self.pool_kernel, self.pool_shift)
        return prompt.local(torch.maximum(layer_ranks(window), layer_ranks(prompt.across_heads(heavy))))


AdaHeavy = compose(
    "adaheavy",
    HeavyWindowScores(window=16, pool_kernel=15, pool_shift=4, group_scores="max"),
    heads=AdaKV(),
    class_name="AdaHeavy",
    module=__name__,
    doc="Ada-Heavy: Ada-KV's allocation over the window's and H2O's ranks combined.",
)
