"""StreamingLLM: attention sinks plus a recent window, nothing scored."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.policies.base import Mode, Policy, PromptKV


@dataclass(frozen=True)
class StreamingLLM(Policy):
    """Keep the first ``sink_tokens`` and the last ``budget - sink_tokens`` tokens of every head."""

    name = "streaming"
    mode = Mode.RELOCATE
    sink_tokens: int = 4

    def keep(self, prompt: PromptKV, budget: int) -> list[torch.Tensor]:
        if prompt.num_tokens <= budget:
            return self.keep_all(prompt)
        sinks = min(self.sink_tokens, budget)
        device = prompt.keys.device
        recent = torch.arange(prompt.num_tokens - (budget - sinks), prompt.num_tokens, device=device)
        kept = torch.cat([torch.arange(sinks, device=device), recent])
        return [kept for _ in range(prompt.num_heads)]
