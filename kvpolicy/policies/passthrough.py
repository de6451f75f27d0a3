"""The two policies that drop nothing: proofs that the plumbing costs no accuracy."""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy.policies.base import CompressedKV, Mode, Policy, PromptKV, RelocatingPolicy


@dataclass(frozen=True)
class NoPolicy(Policy):
    """``none``: every request stays on vLLM's stock path."""

    name = "none"
    mode = Mode.STOCK
    needs_budget = False


@dataclass(frozen=True)
class IdentityPolicy(RelocatingPolicy):
    """``identity``: relocate every prompt into per-head pages, keeping every token."""

    name = "identity"
    needs_budget = False

    def compress(self, prompt: PromptKV, budget: int | None, observation=None) -> CompressedKV:
        return CompressedKV(self.keep_all(prompt))
