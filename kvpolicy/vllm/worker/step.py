"""What one step asks of the attention layers, built once per step by platform-free code.

Each mode's builder (``modes/``) turns vLLM's batch into these records, and
the metadata builder attaches the mode's path to the step (``path``): every
attention layer then runs the step on it (``step.write``, ``step.attend``),
which reads the records through the ops interface (``ops/``). No field
depends on the platform except ``AttentionBatch.plan``, which the ops that
will run the call prepared for it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol

import torch

from kvpolicy.paging import (
    DecodeTables,
    LayerTables,
    OffloadedRequest,
    OffloadPlan,
    PageCopies,
    PageStore,
    RequestPages,
    SharedLayoutPlan,
    SharedPages,
)
from kvpolicy.policies import Policy
from kvpolicy.policies.omnikv import PageChoice

#: ``plan(query_start_loc, seq_lens, block_table, kv_heads, queries_per_kv)``: the ops' own
#: preparation of one attention call (vLLM's scheduler metadata on CPU, virtual-token arrays for Triton).
#: A plan of one-head sequences (``kv_heads == 1``) may depend on the lengths and query layout only,
#: not on the table: the builder shares it between layers whose lengths agree.
Planner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], Any]


#: The platform's own cache write for one layer: of every row (None), or of the rows at these token indices.
PlatformWrite = Callable[[torch.Tensor | None], None]
#: The platform's own attention for one layer, over every row of the batch.
PlatformAttend = Callable[[], Any]


class StepPath(Protocol):
    """What runs a step in each attention layer: its mode's path (``modes/``), over the builder's ops.
    ``out`` is the layer's output as [tokens, q_heads, head_size]; rows the step leaves to the platform
    go through ``platform_write`` and ``platform_attend``."""

    def write(self, layer, key, value, kv_cache, step: Step, platform_write: PlatformWrite) -> None: ...

    def attend(self, layer, query, out, kv_cache, step: Step, platform_attend: PlatformAttend) -> None: ...


@dataclass
class OnPath:
    """A step record that knows the path that runs it (set by the metadata builder that built it)."""

    path: StepPath | None = field(default=None, kw_only=True, repr=False, compare=False)

    def write(self, layer, key, value, kv_cache, platform_write: PlatformWrite) -> None:
        self.path.write(layer, key, value, kv_cache, self, platform_write)

    def attend(self, layer, query, out, kv_cache, platform_attend: PlatformAttend) -> None:
        self.path.attend(layer, query, out, kv_cache, self, platform_attend)


@dataclass
class AttentionBatch:
    """One attention call over a subset of the batch.

    ``kv_heads`` is the model's KV head count for rows in vLLM's own layout
    (``block_table`` holds vLLM block ids), 1 for one-head virtual sequences
    (``block_table`` holds one-head page ids ``b*H + h``). ``in_order``: its rows are the batch's
    first ``len(token_idx)`` tokens, in order (OmniKV's sparse call in a decode step whose every
    row selects), so the CPU ops read ``query`` and write ``out`` in place, without a gather.
    """

    token_idx: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    kv_heads: int
    plan: Any
    in_order: bool = False


@dataclass(frozen=True)
class HeadRows:
    """Virtual tokens of one-head sequences: virtual token ``i`` is KV head ``head_of[i]`` of batch
    token ``token_of[i]``.

    ``whole_batch``: they are every (token, head) of the batch's first ``len(token_of) // H`` tokens
    in token-major order (a decode step whose every row goes per head), so a per-token tensor
    ``[T, H, ...]`` is already in virtual order: the CPU ops then read and write it without a gather.
    """

    token_of: torch.Tensor
    head_of: torch.Tensor
    whole_batch: bool = False


@dataclass
class PerHeadBatch:
    """The relocated requests of a step as ``H`` virtual one-head sequences each.

    Virtual tokens (``rows``) are ordered by (request, head, position), so each virtual sequence's queries are
    contiguous. ``layers[l]`` is layer ``l``'s attention call; ``slots[l]`` where its new K/V go (one-head page slots,
    in virtual-token order). ``req_ids``: the relocated requests, in order. Each layer's ``seq_lens`` is row ``l`` of
    ``seq_lens`` [layers, sequences], and its ``block_table`` row ``l`` of ``tables``, a view of ``store``'s tables
    (its first rows, in this order), which the ops keep on the device by their changes (``ops/staging.TableMirror``).
    ``carried_slots``: for policies that accumulate attention, each request's row of the carried scores
    (``modes/carried.CarriedScores``), in order.
    """

    token_idx: torch.Tensor
    rows: HeadRows
    layers: list[AttentionBatch]
    slots: torch.Tensor
    req_ids: list[str]
    store: PageStore
    seq_lens: torch.Tensor
    tables: torch.Tensor
    carried_slots: torch.Tensor | None = None

    def staged_parts(self) -> list:
        """What ``step_tensors`` searches of the batch: every field but the request ids (strings, one per
        row) and the layers' calls, whose lengths and tables are views of ``seq_lens`` and ``tables``; of
        the calls, only what they share (token indices, query layout, plans), once each. A step of a
        32-layer model is then not searched call by call."""
        parts = [getattr(self, name) for name in _field_names(PerHeadBatch) if name not in ("layers", "req_ids")]
        shared = {id(part): part for call in self.layers for part in (call.token_idx, call.query_start_loc, call.plan)}
        return parts + list(shared.values())


@dataclass
class Relocation:
    """A request whose prompt completes this step: after attention, each layer relocates it.

    ``window_idx``: this step's query tokens that belong to the observation
    window (earlier chunks' share is stashed in the worker state).
    ``num_computed``: tokens in the cache after this step; more than the
    prompt when a preempted request recomputes its prompt and output in one
    go. The policy chooses among prompt tokens; later tokens are all kept.
    Both are None for an eviction pass over a request already relocated
    (prompt chunks, decode): each layer's cache so far, to its own budget.
    ``policy``: the request's (the server's, or one of its family by ``kv_policy``).
    ``summed_queries``: how many of its stashed queries, the first ones, are in its column sums already
    (the window's of summed chunks, for a policy that reads both).
    """

    req_id: str
    policy: Policy
    pages: RequestPages
    num_tokens: int | None
    num_computed: int | None
    budget: int | None
    window_idx: torch.Tensor
    summed_queries: int = 0


@dataclass
class SummedChunk:
    """A prompt chunk of a request whose policy scores every prompt query's attention (H2O, D2O),
    attended by kvpolicy's ops instead of the platform's: one QK^T gives both the chunk's output
    and the column sums its queries add to the request's running sums (``Relocate.add_column_sums``).

    ``token_idx``: the chunk's query tokens in the batch (all prompt tokens, the prompt's last
    positions so far); ``slots`` [kv_heads, seq_len]: one-head slots of every key so far, in
    vLLM's blocks, this chunk's included.
    """

    req_id: str
    token_idx: torch.Tensor
    slots: torch.Tensor


@dataclass
class WindowStash:
    """Window queries in a prompt chunk that is not the last one: kept until the prompt completes."""

    req_id: str
    token_idx: torch.Tensor


@dataclass
class ContextSelection:
    """OmniKV's decode rows of a step: filter layers select their pages, the layers after them attend to those.

    ``token_idx``: the rows' query tokens (one each); ``lengths``: their context lengths (int64); ``table``: the vLLM
    blocks that hold it, [rows, pages] (the choice gathers from it where the scores are); ``page_ids``: those blocks as
    one-head pages, [rows, kv_heads, pages], what the filter layers score; ``choice``: how many pages each row keeps
    (its budget), ``kept`` and ``last`` its mask of kept entries and each row's current page as tensors (staged with
    the step), ``seq_lens`` the tokens they hold (int32). All made once per step, for every filter layer. ``selected``
    fills as the step runs: filter layer -> the sparse layers' one call (the step's stock rows over all their pages,
    then these over their selected ones). ``plan``: the ops' planner for that call.
    """

    token_idx: torch.Tensor
    lengths: torch.Tensor
    table: torch.Tensor
    page_ids: torch.Tensor
    choice: PageChoice
    kept: torch.Tensor
    last: torch.Tensor
    seq_lens: torch.Tensor
    plan: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
    selected: dict[int, AttentionBatch] = field(default_factory=dict)


@dataclass
class OffloadedBatch:
    """OmniKV's decode rows whose sparse layers live in the host pool: ``H`` one-head virtual
    sequences per row over vLLM's whole KV buffer (``WorkerState.page_space``), in every layer.

    Virtual tokens (``rows``) are ordered (row, head). ``slots[l]``: where layer ``l`` writes the
    new K/V; ``flushes``: the full tail pages of every sparse layer, copied to the host before the
    step's first layer writes. ``full[l]``: a full-attention layer's call. ``loaded`` fills as filter
    layers select: sparse layer -> its call over the staging pages, and the pending load of them.
    """

    token_idx: torch.Tensor
    rows: HeadRows
    requests: list[OffloadedRequest]
    budgets: list[int]
    slots: torch.Tensor
    flushes: PageCopies
    full: dict[int, AttentionBatch]
    plan: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
    loaded: dict[int, tuple[AttentionBatch, Any]] = field(default_factory=dict)


@dataclass
class RelocatingStep(OnPath):
    """A step of a relocating policy: ``stock`` is the call of the rows the platform attends as usual
    (None when every row is stock, no row per head or summed); ``platform_layout_tokens``: the tokens
    whose K/V the platform's writer stores in vLLM's blocks, the stock rows and summed chunks (made
    with the step, so its staged copy serves every layer)."""

    stock: AttentionBatch | None = None
    per_head: PerHeadBatch | None = None
    summed: list[SummedChunk] = field(default_factory=list)
    relocations: list[Relocation] = field(default_factory=list)
    window_stash: list[WindowStash] = field(default_factory=list)
    platform_layout_tokens: torch.Tensor | None = None


@dataclass
class SelectingStep(OnPath):
    """A step of OmniKV: ``sources[l]`` is the filter layer whose selection layer ``l`` attends to
    (None: full attention); ``stock`` the rows that attend fully everywhere (in sparse layers, within
    ``context``'s call when there is one); with offloaded rows,
    ``resident`` is every other row's call (full-attention layers)."""

    sources: list[int | None]
    stock: AttentionBatch
    context: ContextSelection | None = None
    offloaded: OffloadedBatch | None = None
    resident: AttentionBatch | None = None
    offloads: list[OffloadPlan] = field(default_factory=list)  # prompts whose sparse layers move after the last layer


@dataclass
class SharedBatch:
    """PoD's decode rows: one new token per row, attended per KV head by ``SharingPath`` over the
    whole KV buffer (``WorkerState.page_space``).

    ``rows``: virtual tokens (row, head); ``slots[l]`` where layer ``l`` writes the new K/V (global
    one-head slots, in ``rows`` order); ``tables``: the rows' pages for ``KVOps.pod_attention``, one
    sequence per virtual token. ``distant_logits`` is made by the step's first layer, where the cache
    is: the lowest layers' scaled logits of the distant tokens, read by the layers above them.
    """

    token_idx: torch.Tensor
    rows: HeadRows
    requests: list[SharedPages]
    slots: torch.Tensor
    tables: DecodeTables
    distant_logits: torch.Tensor | None = None


@dataclass(frozen=True)
class PodDecodeCall:
    """One layer's PoD decode call (``KVOps.pod_attention``, ``kvpolicy_triton.pod_attention``'s arguments):
    sequence ``s`` is KV head ``head_of[s]`` of batch token ``token_of[s]``, over its pages in this layer
    (``tables``)."""

    token_of: torch.Tensor
    head_of: torch.Tensor
    tables: LayerTables
    distant_logits: torch.Tensor
    tau: float | None

    def indices(self) -> tuple[torch.Tensor, ...]:
        """The index tensors, in the kernels' order (between the cache's geometry and ``distant_logits``)."""
        return (self.token_of, self.head_of, *self.tables.indices())


@dataclass
class SharingStep(OnPath):
    """A step of PoD: ``stock`` attends every row but the decode rows in ``shared``; ``layouts``
    are prompts that complete this step, laid out over every layer's pages after the last layer."""

    stock: AttentionBatch
    shared: SharedBatch | None = None
    layouts: list[SharedLayoutPlan] = field(default_factory=list)


@dataclass
class FixedDecodeInputs:
    """What the host adds for a fixed-shape decode step (``modes/fixed_decode.py``) to its relocated rows'
    per-head batch, staged with it: which one-head sequences are those rows' (``relocated``: their lengths,
    slots and page tables come from the batch and the mode's device tables) and which are stock rows'
    (``stock``), with the stock sequences' length, new token's slot and page table (``block * H + h``),
    the same in every layer; ``requests``: the batch's rows that are requests (the rest is padding)."""

    relocated: torch.Tensor
    stock: torch.Tensor
    stock_lens: torch.Tensor
    stock_slots: torch.Tensor
    stock_tables: torch.Tensor
    requests: int


@dataclass
class FixedDecodeStep(OnPath):
    """A relocating mode's decode batch, every row one token, in fixed shapes: one write and one attention
    call per layer over persistent device buffers, the same launches with the same arguments at every step
    of its padded size (what a full CUDA graph replays). ``per_head``: its relocated rows, as built for
    the per-head path; ``calls``: the buffers' views the layers run (``FixedDecodeCalls``)."""

    inputs: FixedDecodeInputs
    per_head: PerHeadBatch | None
    calls: Any = field(repr=False)


Step = RelocatingStep | SelectingStep | SharingStep | FixedDecodeStep


def step_tensors(step: Step):
    """Every tensor a step's records hold, their plans' included: what the ops may ask for on the device
    (``KVOps.stage``), each once (the per-head calls of every layer share their token indices and plans).
    Policies and page stores are not records of the step and are not searched."""
    pending, seen = [step], set()
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, PerHeadBatch):
            pending.extend(item.staged_parts())
        elif dataclasses.is_dataclass(item) and not isinstance(item, Policy):
            pending.extend(map(getattr, repeat(item), _field_names(type(item))))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, read once per class (``dataclasses.fields`` builds them at every call)."""
    return tuple(f.name for f in dataclasses.fields(cls))
