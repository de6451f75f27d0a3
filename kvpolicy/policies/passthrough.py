"""The two policies that drop nothing: proofs that the plumbing costs no accuracy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.policies.base import Policy, PromptKV


@dataclass(frozen=True)
class NoPolicy(Policy):
    """``none``: every request stays on vLLM's stock path."""

    name = "none"
    relocates = False

    def keep(self, prompt: PromptKV) -> list[torch.Tensor]:
        raise RuntimeError("policy 'none' never relocates a request")


@dataclass(frozen=True)
class IdentityPolicy(Policy):
    """``identity``: relocate every prompt into per-head pages, keeping every token."""

    name = "identity"
    relocates = True

    def keep(self, prompt: PromptKV) -> list[torch.Tensor]:
        every = torch.arange(prompt.num_tokens, dtype=torch.int64)
        return [every for _ in range(prompt.num_heads)]
