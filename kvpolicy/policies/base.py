"""What every policy is: a scorer/selector over one layer's prompt KV, with no notion of pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class PromptKV:
    """One layer's view of a finished prompt, as a policy needs it.

    ``keys``: [kv_heads, prompt_len, head_dim]. ``window_queries``: the last
    prompt queries, [q_heads, window, head_dim], or None when the policy is
    attention-free.
    """

    keys: torch.Tensor
    window_queries: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]


@dataclass(frozen=True)
class Policy:
    """A compression policy: which prompt tokens each KV head keeps.

    ``relocates`` says whether a request leaves vLLM's stock layout for
    per-(request, layer, kv-head) pages once its prompt is read.
    """

    name: ClassVar[str]
    relocates: ClassVar[bool]

    def keep(self, prompt: PromptKV) -> list[torch.Tensor]:
        """Kept token indices per KV head, ascending, int64."""
        raise NotImplementedError
