"""What every policy is (a mode, its options as fields) and what a relocating one sees and returns: one layer's KV."""

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
    """One layer's view of a finished prompt, as a policy needs it; in decode (policies that evict as they
    generate), the layer's cache so far in position order, with what the policy carried from its last compression.

    ``keys``, ``values``: [kv_heads, prompt_len, head_dim] (values for policies that rewrite kept tokens).
    ``window_queries``: the last prompt queries, [q_heads, window, head_dim], post-RoPE (None: attention-free).
    ``queries``: every prompt query, [q_heads, prompt_len, head_dim] (H2O, D2O); ``column_sums``: their causal
    attention's column sums, [q_heads, prompt_len] float64, when the backend computed them (the C++ op on CPU).
    ``heads``: this rank's share of the layer's KV heads under tensor parallelism (None: all). Carried into
    decode: ``scores``, [kv_heads, n] float64, accumulated attention; ``threshold``, [kv_heads], D2O's EMA.
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


@dataclass(frozen=True)
class ModeTraits:
    """What the engine must know of a mode before any request arrives (a mode's flags say which mode they
    apply to: ``options.option(mode=...)``)."""

    name: str
    #: Some request attends to something other than vLLM's stock cache.
    changes_attention: bool = True
    #: Requests leave vLLM's stock layout and hand blocks back to its pool.
    frees_blocks: bool = False
    #: A request's pages may move after its prompt is read (PoD lays it out once it has distant tokens).
    moves_after_prompt: bool = False
    #: A request's pages may lie in any layer's part of vLLM's KV buffer (the worker's page space).
    pools_every_layer: bool = False
    #: Why the mode cannot run under pipeline parallelism (None: it runs stage by stage).
    crosses_stages: str | None = None


class Mode(enum.Enum):
    """How the engine runs a policy; each mode has its own per-request state, step builder and attention
    path (``kvpolicy/vllm/worker/modes/``), and what the engine must know of it up front (``traits``)."""

    #: vLLM's own layout and attention, untouched (``none``).
    STOCK = ModeTraits("stock", changes_attention=False)
    #: Once its prompt is read, a request moves to per-(layer, KV head) pages holding only what the policy keeps.
    RELOCATE = ModeTraits("relocate", frees_blocks=True)
    #: Nothing moves; in decode some layers attend only to the pages other layers selected (OmniKV).
    SELECT = ModeTraits(
        "select",
        crosses_stages="its filter layers choose the pages the later layers read, and under pipeline parallelism "
        "the later layers run on another stage, which the selection does not reach",
    )
    #: The request is laid out over every layer's pages at once, some layers reusing a lower layer's logits (PoD).
    SHARE = ModeTraits(
        "share",
        frees_blocks=True,
        moves_after_prompt=True,
        pools_every_layer=True,
        crosses_stages="its layer groups read one layer's attention scores in other layers, and a stage holds only "
        "its own layers' KV",
    )

    @property
    def traits(self) -> ModeTraits:
        return self.value


@dataclass(frozen=True)
class Inputs:
    """What the engine hands a relocating policy besides a layer's keys and values.

    ``window``: the last prompt queries (the policy's ``window`` of them; fewer when a prefix-cache hit
    reached into them). ``attention``: the causal attention column sums of every prompt query (or the
    queries themselves, where the backend cannot sum them); with ``window`` too, the window's queries as
    well, and in a decode pass the column sums of its window's. ``new_token_attention``: in decode each new
    token's attention weights over the cache, added to the scores the policy carried (``PromptKV.scores``).
    """

    window: bool = False
    attention: bool = False
    new_token_attention: bool = False


@dataclass(frozen=True)
class ModelShape:
    """What a policy may check of the served model before it loads (``Policy.check_model``): its name, its
    layers on this worker, its KV heads per rank, the tensor-parallel size, the context limit, and the
    server's ``--kv-ratio``."""

    name: str
    num_layers: int
    num_kv_heads: int
    tensor_parallel: int = 1
    max_model_len: int = 0
    ratio: float | None = None


@dataclass(frozen=True)
class Schedule:
    """When the engine applies a relocating policy; once, at the end of the prompt, unless told more.

    ``per_chunk``: again at every prompt chunk, to the tokens kept so far plus the chunk.
    ``in_decode``: again whenever a page's worth of generated tokens is over budget (every head of a
    layer then keeps the same count). ``across_layers``: a layer's budget depends on what every layer
    observed, so the prompt is compressed after its last layer ran (``RelocatingPolicy.observes_every_layer``).
    """

    per_chunk: bool = False
    in_decode: bool = False
    across_layers: bool = False


@dataclass(frozen=True)
class Policy:
    """A compression policy. Its dataclass fields are its options (``kvpolicy.policies.options``).

    ``mode``: how the engine runs it. ``needs_budget``: a request is given a budget (``--kv-budget``,
    ``--kv-ratio`` or its own ``kv_budget``). ``inputs`` and ``schedule``: what the per-head path hands
    it and when it applies it; nothing and never but for relocating policies.
    """

    name: ClassVar[str]
    mode: ClassVar[Mode]
    needs_budget: ClassVar[bool] = True
    inputs: ClassVar[Inputs] = Inputs()
    schedule: ClassVar[Schedule] = Schedule()

    def check_model(self, model: ModelShape) -> None:
        """Refuse, with a ``ValueError`` that says what to change, a model this policy's settings do not fit
        (most fit any)."""

    @classmethod
    def family(cls) -> tuple:
        """Policies with the same family read the same inputs on the same schedule, so one server can
        serve any of them per request (``kv_policy``); they differ only in which tokens they keep."""
        return cls.mode, cls.needs_budget, cls.inputs, cls.schedule

    @classmethod
    def reads_prefix_cache(cls) -> bool:
        """Whether a prompt may start from prefix-cache hits. Not when every prompt query is scored
        (H2O, D2O: a hit skips computing some), nor when the prompt is evicted chunk by chunk
        (KeyDiff: what it keeps depends on where its chunks end, and a hit moves them)."""
        return not (cls.inputs.attention or cls.schedule.per_chunk)


@dataclass(frozen=True)
class RelocatingPolicy(Policy):
    """A policy the engine runs by relocation: which prompt tokens each KV head keeps (``compress``)."""

    mode = Mode.RELOCATE

    #: Every layer of a prompt is observed (``observe``) before any is compressed, after the last, with what
    #: ``settle`` takes from all of them at once: D2O's layer budgets, Ada-KV's per-head counts (one host read
    #: a prompt, not one a layer). Not part of ``family``: it changes nothing outside the step.
    observes_every_layer: ClassVar[bool] = False

    def compress(self, prompt: PromptKV, budget: int | None, observation: Any = None) -> CompressedKV:
        """What one layer keeps of ``prompt`` with ``budget`` tokens per head on average; ``observation``
        is this layer's ``observe`` when the schedule sets budgets across layers."""
        raise NotImplementedError

    def keep(self, prompt: PromptKV, budget: int | None) -> list[torch.Tensor]:
        """Kept token indices per KV head, ascending, int64."""
        return self.compress(prompt, budget).kept

    def observe(self, prompt: PromptKV, budget: int | None) -> Any:
        """What ``settle`` needs of one layer, taken while its queries are at hand."""
        return None

    def layer_budgets(self, observations: list[Any], budget: int) -> list[int]:
        """Each layer's budget from every layer's ``observe``; by default ``budget`` everywhere."""
        return [budget] * len(observations)

    def settle(self, observations: list[Any], budget: int) -> list[tuple[int, Any]]:
        """Each layer's budget and the observation its ``compress`` takes, once every layer observed (what the
        layers' choices need of the device comes back here, once a prompt)."""
        return list(zip(self.layer_budgets(observations, budget), observations))

    def most_kept(self, budget: int) -> int:
        """The most tokens a head of one layer keeps: ``budget`` on average, one more for rounding."""
        return budget + 1

    def layer_token_bound(self, budget: int | None, prompt_len: int, num_heads: int) -> int:
        """The most (token, head) entries one layer keeps of a prompt."""
        return num_heads * (prompt_len if budget is None else min(self.most_kept(budget), prompt_len))

    @staticmethod
    def keep_all(prompt: PromptKV) -> list[torch.Tensor]:
        every = torch.arange(prompt.num_tokens, dtype=torch.int64, device=prompt.keys.device)
        return [every for _ in range(prompt.num_heads)]
