"""KeyDiff (arXiv:2504.15364): keep the keys least similar to the head's mean key; no attention needed.

Readings we chose (the paper's equations did not survive text extraction;
its prose in §2.4, §3.2 and §3.3 settles them):

- Score (eq. 8, the efficient variant the paper evaluates): for each KV head,
  the anchor is the mean of the L2-normalised keys of that head's cache, and a
  token scores ``-cos(key, anchor)``; the ``budget`` highest scores are kept
  (ties to the earlier position), in float64 so near-ties order the same in
  the policy and its reference.
- Block prompt processing (eq. 6): the next prompt block is appended to the
  cache first, and the policy is then applied to that intermediate cache, so
  the anchor at each step is the mean over the kept tokens *and* the new
  block. A prompt read as a single block gives the same result as ``keep``
  (§2.4: a block size equal to the prompt length is plain prompt-end eviction).
- ``budget`` counts every token a head keeps; KeyDiff keeps no sinks and no
  recent window of its own (Table 1's plain KeyDiff rows).
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
