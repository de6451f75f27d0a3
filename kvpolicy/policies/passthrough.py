"""The two policies that drop nothing: proofs that the plumbing costs no accuracy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.policies.base import Mode, Policy, PromptKV


@dataclass(frozen=True)
class NoPolicy(Policy):
    """``none``: every request stays on vLLM's stock path."""

    name = "none"
    mode = Mode.STOCK
    needs_budget = False

    def keep(self, prompt: PromptKV, budget: int) -> list[torch.Tensor]:
        raise RuntimeError("policy 'none' never relocates a request")


@dataclass(frozen=True)
class IdentityPolicy(Policy):
    """``identity``: relocate every prompt into per-head pages, keeping every token."""

    name = "identity"
    mode = Mode.RELOCATE
    needs_budget = False

    def keep(self, prompt: PromptKV, budget: int) -> list[torch.Tensor]:
        return self.keep_all(prompt)
