"""Policies: pure functions from one layer's prompt KV to kept indices. No vLLM here."""

from kvpolicy.policies.base import Policy, PromptKV
from kvpolicy.policies.passthrough import IdentityPolicy, NoPolicy

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (NoPolicy, IdentityPolicy)}

__all__ = ["POLICIES", "Policy", "PromptKV", "IdentityPolicy", "NoPolicy"]
