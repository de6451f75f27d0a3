"""StreamingLLM: attention sinks plus a recent window, nothing scored."""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy.policies.base import PromptKV
from kvpolicy.policies.compose import Scorer, Split, compose
from kvpolicy.policies.options import not_negative, option


@dataclass(frozen=True)
class SinksAndRecent(Scorer):
    """The first ``sink_tokens`` and the last ``budget - sink_tokens`` tokens of every head take the budget."""

    sink_tokens: int = option(4, "attention-sink tokens always kept", check=not_negative, strict=False)

    def split(self, prompt: PromptKV, budget: int) -> Split:
        sinks = min(self.sink_tokens, budget)
        return Split(sinks, budget - sinks, budget)


StreamingLLM = compose(
    "streaming",
    SinksAndRecent(),
    class_name="StreamingLLM",
    module=__name__,
    doc="StreamingLLM: sinks and the most recent tokens, the same in every head.",
)
