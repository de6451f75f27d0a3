"""What every policy is: a selector over one layer's prompt KV, with no notion of pages."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class HeadGroup:
    """This process's share of a layer's KV heads when tensor parallelism splits them over ``size``
    ranks; ``gather`` stacks every rank's ``[local heads, ...]`` tensor in head order (a collective: every
    rank calls it at the same point)."""

    rank: int
    size: int
    gather: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PromptKV:
    """One layer's view of a finished prompt, as a policy needs it.

    ``keys``: [kv_heads, prompt_len, head_dim]. ``window_queries``: the last
    prompt queries of this layer, [q_heads, window, head_dim] (post-RoPE, as
    attention sees them), or None for attention-free policies. ``queries``:
    every prompt query, [q_heads, prompt_len, head_dim], for policies that
    accumulate attention over the whole prompt (H2O, D2O), and, when the
    backend computed them (the C++ op on CPU), ``column_sums``: their causal
    attention's column sums, [q_heads, prompt_len] float64, as
    ``h2o.attention_column_sums`` defines them. ``values``:
    [kv_heads, prompt_len, head_dim], for policies that rewrite kept tokens
    (D2O merges evicted values into them). ``heads``: this rank's share of
    the layer's KV heads under tensor parallelism (None: all are here).

    In decode (policies that evict as they generate) it is the layer's cache
    so far, tokens in position order, with what the policy carried from its
    last compression: ``scores``, [kv_heads, n] float64, each token's
    accumulated attention; ``threshold``, [kv_heads], D2O's EMA threshold.
    """

    keys: torch.Tensor
    window_queries: torch.Tensor | None = None
    layer: int = 0
    num_layers: int = 1
    queries: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    threshold: torch.Tensor | None = None
    column_sums: torch.Tensor | None = None
    heads: HeadGroup | None = None

    @property
    def num_heads(self) -> int:
        return self.keys.shape[0]

    def across_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """``[local heads, ...]`` as ``[every head of the layer, ...]``: what a layer-wide choice (Ada-KV's
        top-k) ranks over when tensor parallelism split the heads (``heads``); unchanged otherwise."""
        return per_head if self.heads is None else self.heads.gather(per_head)

    def local(self, every_head):
        """This rank's heads of a per-head sequence over every head of the layer."""
        if self.heads is None:
            return every_head
        start = self.heads.rank * self.num_heads
        return every_head[start : start + self.num_heads]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]


@dataclass(frozen=True)
class CompressedKV:
    """What a policy leaves of one layer's prompt.

    ``kept``: positions per KV head, ascending, int64. ``keys``/``values``:
    [kv_heads, kept, head_dim] when the policy rewrote the kept tokens (D2O
    merges evicted tokens into them); None when they stay as they are.
    What a policy that evicts in decode carries to its next compression:
    ``scores``, [kv_heads, kept], the kept tokens' accumulated attention;
    ``threshold``, [kv_heads], D2O's EMA threshold (None before anything was
    evicted).
    """

    kept: list[torch.Tensor]
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    threshold: torch.Tensor | None = None


class Mode(enum.Enum):
    """How the engine runs a policy; each mode has its own per-request state, step builder and attention path."""

    #: vLLM's own layout and attention, untouched (``none``).
    STOCK = "stock"
    #: Once its prompt is read, a request moves to per-(layer, KV head) pages holding only what the policy keeps.
    RELOCATE = "relocate"
    #: Nothing moves; in decode some layers attend only to the pages other layers selected (OmniKV).
    SELECT = "select"
    #: The request is laid out over every layer's pages at once, some layers reusing a lower layer's logits (PoD).
    SHARE = "share"


@dataclass(frozen=True)
class Policy:
    """A compression policy: which prompt tokens each KV head keeps.

    ``mode``: how the engine runs it (``Mode``). ``needs_window``: the backend
    must hand over the last ``window`` prompt queries. ``needs_queries``: it
    must hand over every prompt query, or the column sums of their attention
    (``PromptKV.column_sums``), and the values.
    ``budgets_across_layers``: a layer's budget depends on what every layer
    observed (``observe`` then ``layer_budgets``), so the engine compresses a
    prompt only after its last layer has run. ``evicts_while_reading``: the
    policy is applied again at every prompt chunk (to the tokens kept so far
    plus the chunk). ``evicts_in_decode``: it is applied again whenever a
    page's worth of generated tokens is over budget, so a request never holds
    much more than its budget; such policies keep the same count in every
    head of a layer. ``accumulates_attention``: in decode, each new token's
    attention weights over the cache are added to the cached tokens'
    ``scores`` (the backend computes them beside the fused kernel).
    ``family``: policies that
    differ only in which tokens ``compress`` keeps (same flags, same inputs), so
    one server can serve any of them per request; by default its own name.
    """

    name: ClassVar[str]
    mode: ClassVar[Mode]
    needs_window: ClassVar[bool] = False
    needs_queries: ClassVar[bool] = False
    needs_budget: ClassVar[bool] = True
    budgets_across_layers: ClassVar[bool] = False
    evicts_while_reading: ClassVar[bool] = False
    evicts_in_decode: ClassVar[bool] = False
    accumulates_attention: ClassVar[bool] = False
    family: ClassVar[str | None] = None

    @classmethod
    def family_name(cls) -> str:
        return cls.family or cls.name

    def layer_token_bound(self, budget: int | None, prompt_len: int, num_heads: int) -> int:
        """The most (token, head) entries one layer keeps of a prompt: ``budget`` per head on average,
        and one more per head for rounding. Policies that move budget across layers say more."""
        kept = prompt_len if budget is None else min(budget + 1, prompt_len)
        return num_heads * kept

    @classmethod
    def reads_prefix_cache(cls) -> bool:
        """Whether a prompt may start from prefix-cache hits. Not when every prompt query is scored
        (H2O, D2O: a hit skips computing some), nor when the prompt is evicted chunk by chunk
        (KeyDiff: what it keeps depends on where its chunks end, and a hit moves them)."""
        return not (cls.needs_queries or cls.evicts_while_reading)

    def keep(self, prompt: PromptKV, budget: int) -> list[torch.Tensor]:
        """Kept token indices per KV head, ascending, int64; ``budget`` tokens per head on average."""
        raise NotImplementedError

    def compress(self, prompt: PromptKV, budget: int, observation: Any = None) -> CompressedKV:
        """``keep``, for policies that do not rewrite K/V; ``observation`` is this layer's ``observe``."""
        return CompressedKV(self.keep(prompt, budget))

    def observe(self, prompt: PromptKV) -> Any:
        """What ``layer_budgets`` needs of one layer, taken while its queries are at hand."""
        return None

    def layer_budgets(self, observations: list[Any], budget: int) -> list[int]:
        """Each layer's budget from every layer's ``observe``; by default ``budget`` everywhere."""
        return [budget] * len(observations)

    @staticmethod
    def keep_all(prompt: PromptKV) -> list[torch.Tensor]:
        every = torch.arange(prompt.num_tokens, dtype=torch.int64, device=prompt.keys.device)
        return [every for _ in range(prompt.num_heads)]
