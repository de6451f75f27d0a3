"""Observation-window policies of the Ada-KV paper: SnapKV, Ada-SnapKV, PyramidKV, Ada-Pyramid.

Readings we chose where the paper's text leaves the formula out (its
algorithm boxes did not survive extraction; the authors' code settles them):

- ``budget`` counts every token a KV head keeps, the observation window
  included: the window is always kept, and ``budget - window`` prefix tokens
  are chosen by score.
- Scores: softmax of the window queries against all prompt keys (causal
  inside the window), in float64 (so near-ties order the same everywhere), summed over the window, max-pooled over
  positions (kernel 7). GQA: the pooled scores of the query heads sharing a KV
  head are averaged (the reading kvpress and the authors' GQA branch use).
- Ada-KV allocation (Algorithm 2 with the safeguard): the top
  ``H * (budget - window)`` scores of the layer over all heads at once give
  each head a count ``c_h``; head h then keeps
  ``round((1 - alpha) * c_h + floor(alpha * (budget - window)))`` prefix
  tokens, its own best by score; alpha = 0.5. Ties (max-pooling makes many)
  go to the lower head, then the earlier position.
- Pyramid layer budgets (PyramidKV, beta = 20): prefix capacity falls
  linearly with depth from ``2*base - base//beta`` to ``base//beta`` (capped by
  the prompt), so the mean over layers stays ``base = budget - window``. The
  step is fractional and each layer's capacity rounded: the authors' code
  floors the step instead, which leaves every layer above that line (up to
  ~5% over the budget on average, and a prompt one token over the budget
  kept whole in every layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpolicy.policies.base import Mode, Policy, PromptKV


def window_scores(keys: torch.Tensor, window_queries: torch.Tensor, pool_kernel: int) -> torch.Tensor:
    """Observation-window scores of the prefix tokens, [kv_heads, prompt_len - window].

    ``keys``: [kv_heads, L, D]; ``window_queries``: [q_heads, W, D], the last W
    prompt queries (query head q belongs to KV head ``q // (q_heads // kv_heads)``).
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
    pooled = F.max_pool1d(weights[:, None], kernel_size=pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0]
    return pooled.view(kv_heads, group, -1).mean(dim=1)


def adaptive_counts(scores: torch.Tensor, capacity: int, alpha: float) -> list[int]:
    """Ada-KV: prefix tokens per head from a layer-wide top-k, with the alpha safeguard.

    The counts come back to the host (the layer's one sync: ``heads`` int64): they size each head's
    kept tensor and so its pages. They are tallied by ``scatter_add_``, not ``bincount``, which syncs
    on a GPU to size its output."""
    heads, prefix = scores.shape
    ranked = scores.reshape(-1).argsort(descending=True, stable=True)
    winners = ranked[: heads * capacity] // prefix
    counts = winners.new_zeros(heads).scatter_add_(0, winners, torch.ones_like(winners))
    floor = int(capacity * alpha)
    return torch.round(counts * (1 - alpha) + floor).long().tolist()


def pyramid_capacity(capacity: int, prefix_len: int, layer: int, num_layers: int, beta: int = 20) -> int:
    """PyramidKV: this layer's prefix capacity; the mean over layers stays ``capacity``."""
    low = capacity // beta
    high = 2 * capacity - low
    if high >= prefix_len:
        high = prefix_len
        low = 2 * capacity - high
    step = (high - low) / max(num_layers - 1, 1)
    return round(high - layer * step)


def _keep_top(scores: torch.Tensor, counts: list[int], length: int, window: int) -> list[torch.Tensor]:
    """Each head keeps its ``counts[h]`` best prefix tokens and the whole window, ascending."""
    ordered = scores.argsort(dim=-1, descending=True, stable=True)
    recent = torch.arange(length - window, length, device=scores.device)
    return [torch.cat([ordered[h, :n].sort().values, recent]) for h, n in enumerate(counts)]


@dataclass(frozen=True)
class SnapKV(Policy):
    """Uniform per-head budget, top-k by observation-window score."""

    name = "snapkv"
    family = "snapkv"
    mode = Mode.RELOCATE
    needs_window = True
    window: int = 32
    pool_kernel: int = 7

    def scores(self, prompt: PromptKV) -> torch.Tensor:
        """The prefix tokens' scores, [kv_heads, prompt_len - window]; higher is kept first."""
        return window_scores(prompt.keys, prompt.window_queries, self.pool_kernel)

    def capacities(self, prompt: PromptKV, budget: int, scores: torch.Tensor) -> list[int]:
        return [budget - self.window] * prompt.num_heads

    def keep(self, prompt: PromptKV, budget: int) -> list[torch.Tensor]:
        if prompt.num_tokens <= budget or budget <= self.window:
            return self.keep_all(prompt)
        scores = self.scores(prompt)
        counts = self.capacities(prompt, budget, scores)
        # Fewer window queries than ``window`` when a prefix-cache hit reached into the window
        # (the engine computed only the rest): the window is what was observed.
        return _keep_top(scores, counts, prompt.num_tokens, prompt.window_queries.shape[1])


@dataclass(frozen=True)
class AdaSnapKV(SnapKV):
    """Ada-SnapKV: the layer's budget spread over heads by a layer-wide top-k."""

    name = "adasnap"
    alpha: float = 0.5

    def capacities(self, prompt, budget, scores):
        return prompt.local(adaptive_counts(prompt.across_heads(scores), budget - self.window, self.alpha))


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV: uniform over heads, decreasing with depth."""

    name = "pyramid"
    beta: int = 20

    def layer_capacity(self, prompt: PromptKV, budget: int) -> int:
        prefix = prompt.num_tokens - self.window
        return pyramid_capacity(budget - self.window, prefix, prompt.layer, prompt.num_layers, self.beta)

    def capacities(self, prompt, budget, scores):
        return [self.layer_capacity(prompt, budget)] * prompt.num_heads

    def layer_token_bound(self, budget, prompt_len, num_heads):
        """The lowest layer keeps the most: under twice the mean capacity, plus the window."""
        return num_heads * min(2 * budget + 1, prompt_len)


@dataclass(frozen=True)
class AdaPyramid(PyramidKV):
    """Ada-Pyramid: pyramidal layer budgets, spread over heads as Ada-KV does."""

    name = "adapyramid"
    alpha: float = 0.5

    def capacities(self, prompt, budget, scores):
        capacity = self.layer_capacity(prompt, budget)
        return prompt.local(adaptive_counts(prompt.across_heads(scores), capacity, self.alpha))
