"""SnapKV's scorer, Ada-KV's and PyramidKV's allocators, and the Ada-KV paper's four policies made of them.

The last ``window`` prompt queries score the prefix; a head keeps the window and its best prefix tokens, as many as its
allocator gives: the same count for every head (SnapKV), a layer-wide top-k with a safeguard (Ada-KV), or a capacity
falling with depth (PyramidKV). Our readings where the paper leaves the formula out: docs/policies.md.

Papers: *Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference*,
arXiv:2407.11550; *SnapKV: LLM Knows What You are Looking for Before Generation*, arXiv:2404.14469; *PyramidKV: Dynamic
KV Cache Compression based on Pyramidal Information Funneling*, arXiv:2406.02069. Parameters: ``window`` (32),
``pool_kernel`` (7), ``pool_shift`` (0), ``group_scores`` (mean), ``alpha`` (0.5), ``beta`` (20).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpolicy.policies.base import Inputs, PromptKV
from kvpolicy.policies.compose import HeadAllocator, LayerAllocator, Scorer, Split, compose
from kvpolicy.policies.options import not_negative, one_of, option, positive, positive_odd, unit_interval


def shifted_max_pool(scores: torch.Tensor, kernel: int, shift: int = 0) -> torch.Tensor:
    """[rows, n] scores max-pooled along n: position j gets the max over ``j - kernel//2 - shift ..
    j + kernel//2 - shift``, clipped to the row (a shift spreads a high score over more of the tokens after it)."""
    # Padded by the reach back on both sides, pooled, then cut to the row: output j covers the range above.
    reach = kernel // 2 + shift
    padded = F.pad(scores[:, None], (reach, reach), value=float("-inf"))
    return F.max_pool1d(padded, kernel_size=kernel, stride=1)[:, 0, : scores.shape[1]]


def window_scores(
    keys: torch.Tensor, window_queries: torch.Tensor, pool_kernel: int, pool_shift: int = 0, group_scores: str = "mean"
) -> torch.Tensor:
    """Observation-window scores of the prefix tokens, [kv_heads, prompt_len - window].

    ``keys``: [kv_heads, L, D]; ``window_queries``: [q_heads, W, D], the last W
    prompt queries (query head q belongs to KV head ``q // (q_heads // kv_heads)``).
    Position j's pooled score is the max over ``j - k//2 - pool_shift .. j + k//2 - pool_shift``
    (k the kernel): a shift spreads a high score over more of the tokens after it than before.
    ``group_scores``: ``mean`` or ``max`` of a KV head's query heads' pooled scores.
    """
    kv_heads, length, dim = keys.shape
    q_heads, window, _ = window_queries.shape
    group = q_heads // kv_heads
    expanded = keys.double().repeat_interleave(group, dim=0)
    logits = torch.einsum("hwd,hld->hwl", window_queries.double(), expanded) / math.sqrt(dim)
    query_pos = torch.arange(length - window, length, device=keys.device)
    future = torch.arange(length, device=keys.device)[None, :] > query_pos[:, None]
    logits = logits.masked_fill(future[None], float("-inf"))
    weights = logits.softmax(dim=-1)[:, :, : length - window].sum(dim=1)
    per_query_head = shifted_max_pool(weights, pool_kernel, pool_shift).view(kv_heads, group, -1)
    return per_query_head.amax(dim=1) if group_scores == "max" else per_query_head.mean(dim=1)


def adaptive_counts(scores: torch.Tensor, capacity: int, alpha: float) -> torch.Tensor:
    """Ada-KV: prefix tokens per head from a layer-wide top-k, with the alpha safeguard; [heads] int64
    where the scores are (they reach the host when they size the pages: ``TokenSelector.settle``). Tallied
    by ``scatter_add_``, not ``bincount``, which syncs on a GPU to size its output."""
    heads, prefix = scores.shape
    ranked = scores.reshape(-1).argsort(descending=True, stable=True)
    winners = ranked[: heads * capacity] // prefix
    counts = winners.new_zeros(heads).scatter_add_(0, winners, torch.ones_like(winners))
    floor = int(capacity * alpha)
    return torch.round(counts * (1 - alpha) + floor).long()


def pyramid_capacity(capacity: int, prefix_len: int, layer: int, num_layers: int, beta: int = 20) -> int:
    """PyramidKV: this layer's prefix capacity; the mean over layers stays ``capacity``."""
    low = capacity // beta
    high = 2 * capacity - low
    if high >= prefix_len:
        high = prefix_len
        low = 2 * capacity - high
    step = (high - low) / max(num_layers - 1, 1)
    return round(high - layer * step)


@dataclass(frozen=True)
class WindowScorer(Scorer):
    """A scorer of the last ``window`` prompt queries' attention, max-pooled: the window itself is always kept and
    takes ``window`` tokens of the budget (SnapKV's split, which R-KV's scorer shares)."""

    reads = Inputs(window=True)
    window: int = option(
        32, "observation window: the last prompt queries that score tokens, always kept", check=positive, strict=False
    )
    pool_kernel: int = option(7, "max-pooling kernel over token scores, odd", check=positive_odd, strict=False)

    def split(self, prompt: PromptKV, budget: int) -> Split | None:
        if budget <= self.window:
            return None
        # Fewer window queries than ``window`` when a prefix-cache hit reached into the window
        # (the engine computed only the rest): the window is what was observed.
        return Split(0, prompt.window_queries.shape[1], self.window)


@dataclass(frozen=True)
class ObservationWindow(WindowScorer):
    """SnapKV's scorer: the last ``window`` prompt queries' attention over the prefix, max-pooled."""

    pool_shift: int = option(
        0,
        "moves the max-pooling window this many tokens back, so a high score keeps more of the tokens after it "
        "than before it (0: centred)",
        check=not_negative,
        strict=False,
    )
    group_scores: str = option(
        "mean",
        "how a KV head's query heads' scores combine: mean, or max (a token any one of them attends to)",
        check=one_of("mean", "max"),
        strict=False,
    )

    def scores(self, prompt: PromptKV, observation=None) -> torch.Tensor:
        return window_scores(prompt.keys, prompt.window_queries, self.pool_kernel, self.pool_shift, self.group_scores)


@dataclass(frozen=True)
class AdaKV(HeadAllocator):
    """Ada-KV: the layer's capacity over its heads by one top-k across them, with the alpha safeguard."""

    alpha: float = option(
        0.5,
        "Ada-KV's safeguard: the share of the uniform per-head count every head keeps (1: the same count for every head)",
        check=unit_interval,
    )

    on_device = True

    def counts(self, prompt: PromptKV, scores: torch.Tensor, capacity: int) -> list[int]:
        return self.device_counts(prompt, scores, capacity).tolist()

    def device_counts(self, prompt: PromptKV, scores: torch.Tensor, capacity: int) -> torch.Tensor:
        return prompt.local(adaptive_counts(prompt.across_heads(scores), capacity, self.alpha))


@dataclass(frozen=True)
class Pyramid(LayerAllocator):
    """PyramidKV: capacity falling linearly with depth, its mean over layers the budget's."""

    beta: int = option(20, "PyramidKV: the last layer keeps 1/beta of the mean capacity", flag=None)

    def capacity(self, prompt: PromptKV, capacity: int, candidates: int) -> int:
        return pyramid_capacity(capacity, candidates, prompt.layer, prompt.num_layers, self.beta)

    def most_kept(self, budget: int) -> int:
        """The lowest layer keeps the most: under twice the mean capacity, plus the window."""
        return 2 * budget + 1


SnapKV = compose(
    "snapkv",
    ObservationWindow(),
    class_name="SnapKV",
    module=__name__,
    doc="SnapKV: top-k by observation-window score, the same count in every head.",
)
AdaSnapKV = compose(
    "adasnap",
    ObservationWindow(),
    heads=AdaKV(),
    class_name="AdaSnapKV",
    module=__name__,
    doc="Ada-SnapKV: Ada-KV's allocation over SnapKV's scores.",
)
PyramidKV = compose(
    "pyramid",
    ObservationWindow(),
    layers=Pyramid(),
    class_name="PyramidKV",
    module=__name__,
    doc="PyramidKV: SnapKV's scores, the same count in every head, capacities falling with depth.",
)
AdaPyramid = compose(
    "adapyramid",
    ObservationWindow(),
    layers=Pyramid(),
    heads=AdaKV(),
    class_name="AdaPyramid",
    module=__name__,
    doc="Ada-Pyramid: PyramidKV's layer capacities, spread over heads as Ada-KV does.",
)
