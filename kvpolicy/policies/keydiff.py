"""KeyDiff: keep the keys least similar to the head's mean key; no attention needed.

A token scores ``-cos(key, anchor)``, the anchor being the mean L2-normalised key of the head's cache,
and the ``budget`` best are kept; a prompt read in blocks is evicted after each block is appended (eq. 6),
so it completes in a pool smaller than itself. The readings we chose: docs/policies.md#keydiff.

Paper: *KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments*, arXiv:2504.15364. Parameters: ``budget`` only (no sinks, no recent
window: Table 1's plain KeyDiff).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpolicy.policies.base import PromptKV
from kvpolicy.policies.compose import Scorer, compose


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """``-cos(key, anchor)`` per KV head, [kv_heads, n], the anchor being the mean normalised key of the head."""
    unit = F.normalize(keys.double(), dim=-1)
    anchor = F.normalize(unit.mean(dim=-2, keepdim=True), dim=-1)
    return -(unit * anchor).sum(dim=-1)


def keydiff_block_step(cached_keys: torch.Tensor, block_keys: torch.Tensor, budget: int) -> torch.Tensor:
    """One step of block prompt processing: which tokens of the cache plus the new block survive.

    ``cached_keys``: [kv_heads, n, D], the keys each head kept so far, in
    position order; ``block_keys``: [kv_heads, b, D], the next prompt block.
    Returns indices into ``cat([cached, block])`` (also position order),
    [kv_heads, min(n + b, budget)], ascending. Every head keeps the same count,
    so the heads go together.
    """
    keys = torch.cat([cached_keys, block_keys], dim=1)
    heads, length, _ = keys.shape
    if length <= budget:
        return torch.arange(length, device=keys.device).expand(heads, -1)
    ranked = keydiff_scores(keys).argsort(dim=-1, descending=True, stable=True)
    return ranked[:, :budget].sort(dim=-1).values


@dataclass(frozen=True)
class KeyDiffScores(Scorer):
    """``-cos(key, anchor)`` over whatever the layer holds: no attention needed, nothing kept unscored."""

    def scores(self, prompt: PromptKV, observation=None) -> torch.Tensor:
        return keydiff_scores(prompt.keys)


KeyDiff = compose(
    "keydiff",
    KeyDiffScores(),
    per_chunk=True,
    in_decode=True,
    class_name="KeyDiff",
    module=__name__,
    doc="KeyDiff over whatever the cache holds: applied at every prompt chunk and as decode fills pages.",
)
