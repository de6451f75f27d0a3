"""R-KV's scorer: attention importance minus redundancy among the keys, for outputs that repeat themselves.

Long generated outputs (reasoning traces) say the same thing many times; attention alone keeps every copy. R-KV
scores each token by its window attention (importance ``I``) less how much its key resembles the others
(redundancy ``R``): ``Z = lambda * I - (1 - lambda) * R``, each head keeping its best ``Z`` and the window. Among
near-duplicate keys (cosine above a threshold) the most recent copy keeps its score and older ones lose theirs.
It runs where the SnapKV family does: at a prompt's end, and in decode once the cache passes budget plus
``--kv-decode-buffer``, scored with the latest generated queries. Our readings of the paper: docs/policies.md#r-kv.

Paper: *R-KV: Redundancy-aware KV Cache Compression for Reasoning Models*, arXiv:2505.24133. Parameters:
``window`` (8), ``pool_kernel`` (7), ``importance_weight`` (lambda, 0.1), ``duplicate_similarity`` (0.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpolicy.policies.base import PromptKV
from kvpolicy.policies.compose import compose
from kvpolicy.policies.options import option, unit_interval
from kvpolicy.policies.snapkv import WindowScorer, shifted_max_pool

#: Rows of the cosine matrix built at a time: a long prompt's n x n matrix never exists whole.
SIMILARITY_ROWS = 256


def importance_scores(keys: torch.Tensor, window_queries: torch.Tensor, pool_kernel: int) -> torch.Tensor:
    """R-KV's importance of the tokens before the window, [kv_heads, n - window]: a KV head's query heads'
    largest logit, a softmax over those tokens only, the mean over the window's queries, max-pooled."""
    kv_heads, length, dim = keys.shape
    q_heads, window, _ = window_queries.shape
    prefix = length - window
    queries = window_queries.double().view(kv_heads, q_heads // kv_heads, window, dim)
    logits = torch.einsum("hgwd,hld->hgwl", queries, keys[:, :prefix].double()) / math.sqrt(dim)
    weights = logits.amax(dim=1).softmax(dim=-1).mean(dim=1)
    return shifted_max_pool(weights, pool_kernel)


def redundancy_scores(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's redundancy of every token, [kv_heads, n]: the softmax over tokens of the mean cosine similarity
    of the other keys to its key, where each key's most recent look-alike (the last position above
    ``threshold``; position 0 when none) does not count, so the newest of near-duplicates scores lowest."""
    unit = F.normalize(keys.double(), dim=-1)
    heads, n, _ = unit.shape
    positions = torch.arange(n, device=keys.device)
    received = torch.zeros(heads, n, dtype=torch.float64, device=keys.device)
    for start in range(0, n, SIMILARITY_ROWS):
        rows = positions[start : start + SIMILARITY_ROWS]
        similarity = torch.einsum("hid,hjd->hij", unit[:, rows], unit)
        similarity[:, rows - start, rows] = 0
        latest = torch.where(similarity > threshold, positions, -1).amax(dim=-1).clamp(min=0)
        similarity.scatter_(-1, latest[..., None], 0.0)
        received += similarity.sum(dim=1)
    return (received / n).softmax(dim=-1)


@dataclass(frozen=True)
class RedundancyAware(WindowScorer):
    """``lambda * importance - (1 - lambda) * redundancy`` of the tokens before the window, which is kept."""

    importance_weight: float = option(
        0.1,
        "R-KV's lambda: attention importance's weight against key redundancy (1: attention only)",
        check=unit_interval,
    )
    duplicate_similarity: float = option(
        0.5,
        "R-KV: the key cosine similarity above which two tokens look alike; a token's most recent look-alike is not "
        "counted redundant for it",
        check=unit_interval,
    )

    def scores(self, prompt: PromptKV, observation=None) -> torch.Tensor:
        importance = importance_scores(prompt.keys, prompt.window_queries, self.pool_kernel)
        redundancy = redundancy_scores(prompt.keys, self.duplicate_similarity)[:, : importance.shape[1]]
        return self.importance_weight * importance - (1 - self.importance_weight) * redundancy


RKV = compose(
    "rkv",
    RedundancyAware(window=8),
    class_name="RKV",
    module=__name__,
    doc="R-KV: window attention less key redundancy, the same count in every head.",
)
