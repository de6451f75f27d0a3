"""The per-head attention backend: vLLM's CPU attention, plus per-(request, kv-head) pages.

Requests that a policy has relocated attend as ``H`` virtual one-head
sequences over the same cache viewed as one-head pages (block ``b``, head
``h`` is page ``b*H + h``), each with its own physical length and block
table per layer. Every other request in the batch takes vLLM's stock path,
unchanged. Positions stay logical: vLLM computes them from its own token
counts, which relocation never touches.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpolicy.paging import OffloadedRequest, OffloadPlan, PageCopies, PageLayout, RequestPages
from kvpolicy.policies import PromptKV
from kvpolicy.policies.h2o import add_new_token, new_token_attention
from kvpolicy.policies.omnikv import context_scores, select_pages
from kvpolicy.vllm.args import REQUEST_BUDGET_KEY
from kvpolicy.vllm.internals import (
    CPU_ATTN_MODULE,
    envs,
    extract_layer_index,
    get_forward_context,
    ops,
)
from kvpolicy.vllm.state import WORKER_STATE, CarriedState

_cpu_attn = importlib.import_module(CPU_ATTN_MODULE)
CPUAttentionBackend = _cpu_attn.CPUAttentionBackend
CPUAttentionBackendImpl = _cpu_attn.CPUAttentionBackendImpl
CPUAttentionMetadata = _cpu_attn.CPUAttentionMetadata
CPUAttentionMetadataBuilder = _cpu_attn.CPUAttentionMetadataBuilder


@dataclass
class AttentionBatch:
    """Arguments of one ``cpu_attention_with_kv_cache`` call over a subset of the batch."""

    token_idx: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class PerHeadBatch:
    """The relocated requests of a step as ``H`` virtual one-head sequences each.

    Virtual token ``i`` is query token ``token_of[i]`` of the batch, KV head
    ``head_of[i]``; tokens are ordered by (request, head, position), so each
    virtual sequence's queries are contiguous. ``layers[l]`` is layer ``l``'s
    attention call; ``slots[l]`` where its new K/V go (one-head page slots, in
    virtual-token order). ``req_ids``: the relocated requests, in order.
    """

    token_idx: torch.Tensor
    token_of: torch.Tensor
    head_of: torch.Tensor
    layers: list[AttentionBatch]
    slots: torch.Tensor
    req_ids: list[str]


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
    """

    req_id: str
    pages: RequestPages
    num_tokens: int | None
    num_computed: int | None
    budget: int | None
    window_idx: torch.Tensor


@dataclass
class WindowStash:
    """Window queries in a prompt chunk that is not the last one: kept until the prompt completes."""

    req_id: str
    token_idx: torch.Tensor


@dataclass
class ContextSelection:
    """OmniKV's decode rows of a step: filter layers select their pages, the layers after them attend to those.

    ``token_idx``: the rows' query tokens (one each); ``seq_lens`` and
    ``block_table``: their whole context in vLLM's blocks; ``budgets``: tokens
    a sparse layer attends to, per row. ``selected``
    fills as the step runs: filter layer -> the sparse layers' call.
    ``schedule``: scheduler metadata for a call over these rows.
    """

    token_idx: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    budgets: list[int]
    schedule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    selected: dict[int, AttentionBatch] = field(default_factory=dict)


@dataclass
class OffloadedBatch:
    """OmniKV's decode rows whose sparse layers live in the host pool: ``H`` one-head virtual
    sequences per row over vLLM's whole KV buffer (``WorkerState.page_space``), in every layer.

    Virtual token ``i`` is query token ``token_of[i]``, KV head ``head_of[i]`` (ordered row, head).
    ``slots[l]``: where layer ``l`` writes the new K/V; ``flushes[l]``: full tail pages it copies
    to the host first. ``full[l]``: a full-attention layer's call. ``chosen`` fills as filter
    layers select: filter layer -> per row, the page indices its sparse layers read.
    """

    token_idx: torch.Tensor
    token_of: torch.Tensor
    head_of: torch.Tensor
    requests: list[OffloadedRequest]
    budgets: list[int]
    slots: torch.Tensor
    flushes: list[PageCopies]
    full: dict[int, AttentionBatch]
    schedule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    chosen: dict[int, list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class KVPolicyMetadata(CPUAttentionMetadata):
    """Stock metadata plus the per-head or context-selection part; ``stock`` is the other rows' own call.

    OmniKV: ``sources[l]`` is the filter layer whose selection layer ``l`` attends to (None: full
    attention); with offloaded rows, ``resident`` is every other row's call (full-attention layers).
    """

    stock: AttentionBatch | None = None
    per_head: PerHeadBatch | None = None
    relocations: list[Relocation] = field(default_factory=list)
    window_stash: list[WindowStash] = field(default_factory=list)
    context: ContextSelection | None = None
    offloaded: OffloadedBatch | None = None
    resident: AttentionBatch | None = None
    offloads: list[OffloadPlan] = field(default_factory=list)  # prompts whose sparse layers move after the last layer
    sources: list[int | None] | None = None


class KVPolicyCPUBackend(CPUAttentionBackend):
    """Registered over ``CPU_ATTN``; keeps its name so vLLM treats it as the CPU backend."""

    @staticmethod
    def get_impl_cls():
        return KVPolicyCPUImpl

    @staticmethod
    def get_builder_cls():
        return KVPolicyCPUMetadataBuilder


class KVPolicyCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.queries_per_kv = self.num_heads // self.num_kv_heads

    def _scheduler_metadata(self, seq_lens, query_start_loc, *, num_heads, num_kv_heads):
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=self.head_dim,
            seq_lens=seq_lens,
            dtype=self.dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=self.window_size,
            isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.is_cross_attention or self.is_encoder_only_attention:
            return metadata
        if WORKER_STATE.selects_context:
            return self._with_context_selection(metadata, common_attn_metadata)
        if not WORKER_STATE.relocates:
            return metadata
        cam = common_attn_metadata
        runner = WORKER_STATE.runner
        num_reqs = cam.num_reqs
        qsl = cam.query_start_loc_cpu[: num_reqs + 1].numpy()
        seq_lens = cam.seq_lens[:num_reqs].cpu().numpy()
        block_table = cam.block_table_tensor
        per_head_rows, relocations, stash = [], [], []
        policy = WORKER_STATE.policy
        for row, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            query_len = int(qsl[row + 1] - qsl[row])
            seq_len = int(seq_lens[row])
            start = seq_len - query_len
            num_blocks = -(-seq_len // self.block_size)
            request = runner.requests[req_id]
            prompt_len = request.num_prompt_tokens
            pages = WORKER_STATE.requests.get(req_id)
            if pages is not None and start == 0:
                # Preempted and recomputed from scratch: compression is redone.
                WORKER_STATE.forget([req_id])
                pages = None
            if query_len == 0:
                continue
            if pages is None and start >= prompt_len:
                continue
            override = (request.sampling_params.extra_args or {}).get(REQUEST_BUDGET_KEY)
            budget = WORKER_STATE.config.budget_for(prompt_len, override)
            if pages is not None:
                pages.add_blocks(block_table[row, len(pages.blocks) : num_blocks].tolist())
                per_head_rows.append((row, req_id, pages, query_len))
                reading = start < prompt_len
                evicts = policy.evicts_while_reading if reading else policy.evicts_in_decode
                if evicts and self._evicts_now(req_id, pages, query_len, reading):
                    done = reading and prompt_len <= seq_len
                    relocations.append(self._relocation(req_id, pages, None, None, None, done))
                continue
            if budget is None and policy.needs_budget:
                continue  # short prompt: stays on the stock path
            window_idx = self._window_tokens(int(qsl[row]), start, seq_len, prompt_len)
            reading = seq_len < request.num_tokens  # the prompt (after a preemption: prompt and output)
            if reading and not (policy.evicts_while_reading and seq_len > budget):
                if window_idx.numel():
                    stash.append(WindowStash(req_id, window_idx))
                continue
            pages = RequestPages(
                self.num_layers, self.num_kv_heads, self.block_size, block_table[row, :num_blocks].tolist()
            )
            WORKER_STATE.requests[req_id] = pages
            chooses = seq_len if reading else prompt_len
            relocations.append(self._relocation(req_id, pages, chooses, seq_len, budget, not reading, window_idx))
        metadata = KVPolicyMetadata(**vars(metadata), relocations=relocations, window_stash=stash)
        if per_head_rows:
            metadata.per_head = self._per_head_batch(per_head_rows, qsl)
            stock_rows = sorted(set(range(num_reqs)) - {row for row, _, _, _ in per_head_rows})
            metadata.stock = self._stock_batch(stock_rows, qsl, cam)
        return metadata

    @functools.cached_property
    def _source_layers(self) -> list[int | None]:
        return WORKER_STATE.policy.source_layers(self.num_layers)

    def _with_context_selection(self, metadata, cam):
        """OmniKV: decode rows whose context is over their budget attend sparsely in the sparse layers;
        with ``--kv-offload``, prompts over budget move their sparse layers to the host pool."""
        runner = WORKER_STATE.runner
        config = WORKER_STATE.config
        num_reqs = cam.num_reqs
        qsl = cam.query_start_loc_cpu[: num_reqs + 1].numpy()
        seq_lens = cam.seq_lens[:num_reqs].cpu().numpy()
        rows, budgets, offloaded_rows, offloads = [], [], [], []
        for row, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            request = runner.requests[req_id]
            seq_len = int(seq_lens[row])
            query_len = int(qsl[row + 1] - qsl[row])
            offloaded = WORKER_STATE.offloaded.get(req_id)
            if offloaded is not None and seq_len == query_len:
                WORKER_STATE.forget([req_id])  # preempted and recomputed from scratch
                offloaded = None
            override = (request.sampling_params.extra_args or {}).get(REQUEST_BUDGET_KEY)
            budget = config.sparse_budget(seq_len, self.num_layers, override)
            if offloaded is not None:
                if query_len != 1:
                    raise RuntimeError("an offloaded request takes one new token per step")
                offloaded_rows.append((row, offloaded, budget))
                continue
            decoding = query_len == 1 and request.num_prompt_tokens < seq_len == request.num_tokens
            if not decoding:
                if WORKER_STATE.offloads and seq_len == request.num_tokens and budget < seq_len:
                    offload = self._offload(req_id, cam.block_table_tensor[row], seq_len, budget)
                    if offload is not None:
                        offloads.append(offload)
                continue  # prompt (or recompute) chunks: full attention
            if budget < seq_len:
                rows.append(row)
                budgets.append(budget)
        if not (rows or offloaded_rows or offloads):
            return metadata
        schedule = functools.partial(self._scheduler_metadata, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        context = None
        if rows:
            row_idx = torch.tensor(rows, dtype=torch.int64)
            context = ContextSelection(
                token_idx=torch.from_numpy(qsl[rows].astype(np.int64)),
                seq_lens=cam.seq_lens[row_idx],
                block_table=cam.block_table_tensor[row_idx],
                budgets=budgets,
                schedule=schedule,
            )
        away = {row for row, _, _ in offloaded_rows}
        stock_rows = sorted(set(range(num_reqs)) - set(rows) - away)
        metadata = KVPolicyMetadata(
            **vars(metadata),
            context=context,
            stock=self._stock_batch(stock_rows, qsl, cam),
            offloads=offloads,
            sources=self._source_layers,
        )
        if offloaded_rows:
            metadata.offloaded = self._offloaded_batch(offloaded_rows, qsl, cam)
            metadata.resident = self._stock_batch(sorted(set(range(num_reqs)) - away), qsl, cam)
        return metadata

    def _offload(self, req_id: str, block_table, length: int, budget: int) -> OffloadPlan | None:
        """Plan the offload of a prompt that completes this step; None when the host pool is full."""
        space = WORKER_STATE.page_space()
        num_blocks = -(-length // self.block_size)
        sources = self._source_layers
        request = OffloadedRequest(
            space.layer_base, self.num_kv_heads, self.block_size, block_table[:num_blocks].tolist(),
            [source is None for source in sources],
        )
        staging = -(-budget // self.block_size) - 1
        try:
            plan = request.offload(length, WORKER_STATE.host_pool(), staging, self.vllm_config.model_config.max_model_len)
        except MemoryError:
            WORKER_STATE.counters["offload_refused"] += 1
            return None
        WORKER_STATE.offloaded[req_id] = request
        WORKER_STATE.offloaded_this_step[req_id] = plan.keep_blocks
        return plan

    def _offloaded_batch(self, rows, qsl, cam) -> OffloadedBatch:
        heads = self.num_kv_heads
        host = WORKER_STATE.host_pool()
        slots, flushes = [], []
        for row, request, _ in rows:
            num_blocks = -(-(request.length + 1) // self.block_size)
            request.add_blocks(cam.block_table_tensor[row, len(request.blocks) : num_blocks].tolist())
            row_slots, row_flushes = request.append(host)
            slots.append(row_slots)
            flushes.append(row_flushes)
        token_idx = torch.tensor([int(qsl[row]) for row, _, _ in rows], dtype=torch.int64)
        requests = [request for _, request, _ in rows]
        query_start_loc = torch.arange(len(rows) * heads + 1, dtype=torch.int32)
        seq_lens = torch.tensor([r.length for r in requests], dtype=torch.int32).repeat_interleave(heads)
        schedule = functools.partial(self._scheduler_metadata, num_heads=self.queries_per_kv, num_kv_heads=1)
        full_schedule = schedule(seq_lens, query_start_loc)
        full = {
            layer: AttentionBatch(
                token_idx,
                query_start_loc,
                seq_lens,
                padded_table([pages for request in requests for pages in request.full_table(layer)]),
                full_schedule,
            )
            for layer, source in enumerate(self._source_layers)
            if source is None
        }
        return OffloadedBatch(
            token_idx=token_idx,
            token_of=token_idx.repeat_interleave(heads),
            head_of=torch.arange(heads).repeat(len(rows)),
            requests=requests,
            budgets=[budget for _, _, budget in rows],
            slots=torch.stack(slots, dim=1).reshape(self.num_layers, -1),
            flushes=[PageCopies.cat([row[layer] for row in flushes]) for layer in range(self.num_layers)],
            full=full,
            schedule=schedule,
        )

    @staticmethod
    def _relocation(req_id, pages, num_tokens, num_computed, budget, prompt_done, window_idx=None) -> Relocation:
        WORKER_STATE.relocated_this_step[req_id] = prompt_done
        if window_idx is None:
            window_idx = torch.zeros(0, dtype=torch.int64)
        return Relocation(req_id, pages, num_tokens, num_computed, budget, window_idx)

    def _evicts_now(self, req_id: str, pages: RequestPages, query_len: int, reading: bool) -> bool:
        """An evicting policy compresses at every prompt chunk over budget, and in decode once some
        layer is a page's worth over its budget (then every layer over budget is brought back to it)."""
        lengths = pages.lengths
        if (lengths != lengths[:, :1]).any():
            raise RuntimeError("a policy that evicts must keep the same count in every head of a layer")
        over = lengths[:, 0] + query_len - np.asarray(WORKER_STATE.carried[req_id].budgets)
        return over.max() > 0 if reading else over.max() >= self.block_size

    @staticmethod
    def _window_tokens(first_token: int, start: int, end: int, prompt_len: int) -> torch.Tensor:
        """Batch indices of this chunk's tokens whose queries the policy scores with.

        The observation window (the last ``window`` prompt tokens), or every
        prompt token for policies that accumulate attention over the prompt.
        """
        policy = WORKER_STATE.policy
        if policy.needs_queries:
            window = prompt_len
        elif policy.needs_window:
            window = WORKER_STATE.config.window
        else:
            return torch.zeros(0, dtype=torch.int64)
        window_start = max(prompt_len - window, start)
        window_end = max(min(end, prompt_len), window_start)
        return torch.arange(first_token + window_start - start, first_token + window_end - start)

    def _per_head_batch(self, rows, qsl) -> PerHeadBatch:
        heads = self.num_kv_heads
        token_idx = torch.cat([torch.arange(int(qsl[row]), int(qsl[row]) + q) for row, _, _, q in rows])
        token_of, head_of, slots = [], [], []
        for row, _, pages, query_len in rows:
            tokens = torch.arange(int(qsl[row]), int(qsl[row]) + query_len)
            token_of.append(tokens.repeat(heads))
            head_of.append(torch.arange(heads).repeat_interleave(query_len))
            slots.append(pages.append(query_len).transpose(0, 2, 1).reshape(self.num_layers, -1))  # [layers, H*q]
        query_lens = torch.tensor([query_len for _, _, _, query_len in rows]).repeat_interleave(heads)
        query_start_loc = torch.zeros(query_lens.numel() + 1, dtype=torch.int32)
        query_start_loc[1:] = query_lens.cumsum(0)
        lengths = np.stack([pages.lengths for _, _, pages, _ in rows], axis=1)
        width = max(pages.max_pages() for _, _, pages, _ in rows)
        tables = torch.from_numpy(np.concatenate([pages.page_table(width) for _, _, pages, _ in rows], axis=1))
        layers, by_lengths = [], {}
        for layer in range(self.num_layers):
            seq_lens = torch.from_numpy(lengths[layer].reshape(-1).astype(np.int32))
            key = seq_lens.numpy().tobytes()
            if key not in by_lengths:
                by_lengths[key] = self._scheduler_metadata(
                    seq_lens, query_start_loc, num_heads=self.queries_per_kv, num_kv_heads=1
                )
            layers.append(AttentionBatch(token_idx, query_start_loc, seq_lens, tables[layer], by_lengths[key]))
        return PerHeadBatch(
            token_idx,
            torch.cat(token_of),
            torch.cat(head_of),
            layers,
            torch.from_numpy(np.concatenate(slots, axis=1)),
            [req_id for _, req_id, _, _ in rows],
        )

    def _stock_batch(self, rows, qsl, cam) -> AttentionBatch:
        query_lens = [int(qsl[row + 1] - qsl[row]) for row in rows]
        token_idx = torch.cat(
            [torch.arange(int(qsl[row]), int(qsl[row + 1])) for row in rows] or [torch.zeros(0, dtype=torch.int64)]
        )
        query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        row_idx = torch.tensor(rows, dtype=torch.int64)
        seq_lens = cam.seq_lens[row_idx]
        return AttentionBatch(
            token_idx,
            query_start_loc,
            seq_lens,
            cam.block_table_tensor[row_idx],
            self._scheduler_metadata(seq_lens, query_start_loc, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads),
        )


def padded_table(rows: list[list[int]]) -> torch.Tensor:
    """A block table with one row per virtual sequence, zero-padded to the longest."""
    table = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int32)
    for i, pages in enumerate(rows):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table


@functools.lru_cache(maxsize=None)
def layer_index(layer_name: str) -> int:
    """vLLM's index of an attention layer, parsed once per name: every layer asks at every step."""
    return extract_layer_index(layer_name)


@functools.lru_cache(maxsize=None)
def page_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> PageLayout:
    """Discover where the cache writer puts (token, dim) inside a page, exactly.

    Two writes of a scratch page through ``cpu_attn_reshape_and_cache``: once
    with each element's token id, once with its dim id.
    """
    cache = torch.zeros(2, 1, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(2, 1, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(block_size) + block_size
    maps = []
    for values in (
        torch.arange(block_size).view(-1, 1, 1).expand(block_size, 1, head_size),
        torch.arange(head_size).view(1, 1, -1).expand(block_size, 1, head_size),
    ):
        values = values.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(values, values, key_cache, value_cache, slots, isa)
        maps.append(cache[1, 0].reshape(-1).long().clone())
    return PageLayout.from_token_and_dim_maps(*maps)


class KVPolicyCPUImpl(CPUAttentionBackendImpl):
    """Stock attention for stock rows, per-head attention for relocated ones."""

    @staticmethod
    def _metadata(layer) -> KVPolicyMetadata | None:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata.get(layer.layer_name)
        return metadata if isinstance(metadata, KVPolicyMetadata) else None

    @staticmethod
    def _split(kv_cache: torch.Tensor):
        """K and V halves of a cache [blocks, heads, block_size, 2*head_size], as the CPU ops take them."""
        num_blocks, num_kv_heads, block_size, width = kv_cache.shape
        return kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)

    @staticmethod
    def _one_head_pages(kv_cache: torch.Tensor) -> torch.Tensor:
        """A layer's cache as one-head pages [blocks * heads, 1, block_size, 2*head_size]: page ``b*H + h``."""
        return kv_cache.view(-1, 1, *kv_cache.shape[2:])

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        metadata = self._metadata(layer)
        if metadata is None or (metadata.per_head is None and metadata.offloaded is None):
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        layer_idx = layer_index(layer.layer_name)
        heads_batch = metadata.per_head or metadata.offloaded
        stock_idx = (metadata.stock if metadata.per_head is not None else metadata.resident).token_idx
        if stock_idx.numel():
            super().do_kv_cache_update(layer, key[stock_idx], value[stock_idx], kv_cache, slot_mapping[stock_idx])
        if metadata.per_head is not None:
            pages = self._one_head_pages(kv_cache)
        else:
            pages = WORKER_STATE.page_space().pages
            flush = metadata.offloaded.flushes[layer_idx]
            WORKER_STATE.counters["offloaded_kv_pages"] += flush.apply(pages.flatten(1), WORKER_STATE.host.pages)
        key_cache, value_cache = self._split(pages)
        heads = self.num_kv_heads
        ops.cpu_attn_reshape_and_cache(
            key.reshape(-1, heads, self.head_size)[heads_batch.token_of, heads_batch.head_of].unsqueeze(1),
            value.reshape(-1, heads, self.head_size)[heads_batch.token_of, heads_batch.head_of].unsqueeze(1),
            key_cache,
            value_cache,
            heads_batch.slots[layer_idx],
            layer.isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def _attend(self, layer, query, output, key_cache, value_cache, batch: AttentionBatch) -> None:
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=output,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window,
            block_table=batch.block_table,
            softcap=self.logits_soft_cap,
            scheduler_metadata=batch.scheduler_metadata,
            s_aux=self.sinks,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, KVPolicyMetadata) and WORKER_STATE.selects_context:
            return self._forward_selecting(layer, query, key, value, kv_cache, attn_metadata, output)
        if not isinstance(attn_metadata, KVPolicyMetadata) or attn_metadata.per_head is None:
            output = super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        else:
            self._forward_mixed(layer, query, kv_cache, attn_metadata, output)
        if isinstance(attn_metadata, KVPolicyMetadata):
            layer_idx = layer_index(layer.layer_name)
            for stash in attn_metadata.window_stash:
                WORKER_STATE.stash_window(stash.req_id, layer_idx, query[stash.token_idx])
            if attn_metadata.per_head is not None and WORKER_STATE.policy.accumulates_attention:
                self._add_attention(layer.isa, query, kv_cache, layer_idx, attn_metadata.per_head)
            if attn_metadata.relocations:
                self._relocate(layer, query, kv_cache, attn_metadata.relocations)
        return output

    def _attend_rows(self, layer, query, out, kv_cache, batch: AttentionBatch) -> None:
        """One call over a subset of the batch's rows in vLLM's own layout; results written into ``out``."""
        if batch.token_idx.numel():
            rows_out = torch.empty_like(query[batch.token_idx])
            self._attend(layer, query[batch.token_idx], rows_out, *self._split(kv_cache), batch)
            out[batch.token_idx] = rows_out

    def _attend_heads(self, layer, query, out, pages, batch: AttentionBatch, token_of, head_of) -> None:
        """One call over one-head virtual sequences (query token ``token_of[i]``, KV head ``head_of[i]``)
        on ``pages``, one-head pages [pages, 1, block_size, 2*head_size]; results written into ``out``."""
        by_kv_head = (-1, self.num_kv_heads, self.num_queries_per_kv, self.head_size)
        head_query = query.view(by_kv_head)[token_of, head_of]
        head_out = torch.empty_like(head_query)
        self._attend(layer, head_query, head_out, *self._split(pages), batch)
        out.view(by_kv_head)[token_of, head_of] = head_out

    def _forward_mixed(self, layer, query, kv_cache, metadata: KVPolicyMetadata, output) -> None:
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        self._attend_rows(layer, query, out, kv_cache, metadata.stock)
        per_head = metadata.per_head
        batch = per_head.layers[layer_index(layer.layer_name)]
        pages = self._one_head_pages(kv_cache)
        self._attend_heads(layer, query, out, pages, batch, per_head.token_of, per_head.head_of)

    def _forward_selecting(self, layer, query, key, value, kv_cache, metadata: KVPolicyMetadata, output):
        """OmniKV: full attention, then a selection in filter layers; sparse layers attend to the selection.

        Offloaded rows attend per head over the whole KV buffer: full layers to their own pages, sparse
        layers to the selected pages loaded from the host pool into staging pages, then their tail.
        """
        context, offloaded = metadata.context, metadata.offloaded
        layer_idx = layer_index(layer.layer_name)
        source = metadata.sources[layer_idx]
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        pages = WORKER_STATE.page_space().pages if offloaded is not None or metadata.offloads else None
        if source is None:
            if offloaded is None:
                output = super().forward(layer, query, key, value, kv_cache, metadata, output)
            else:
                self._attend_rows(layer, query, out, kv_cache, metadata.resident)
                self._attend_heads(
                    layer, query, out, pages, offloaded.full[layer_idx], offloaded.token_of, offloaded.head_of
                )
            if layer_idx in WORKER_STATE.policy.filter_layers:
                if context is not None:
                    context.selected[layer_idx] = self._select(layer.isa, query, kv_cache, context)
                if offloaded is not None:
                    offloaded.chosen[layer_idx] = self._select_offloaded(layer.isa, query, pages, layer_idx, offloaded)
        else:
            self._attend_rows(layer, query, out, kv_cache, metadata.stock)
            if context is not None:
                self._attend_rows(layer, query, out, kv_cache, context.selected[source])
            if offloaded is not None:
                batch = self._load_selection(pages, layer_idx, offloaded, offloaded.chosen[source])
                self._attend_heads(layer, query, out, pages, batch, offloaded.token_of, offloaded.head_of)
        if metadata.offloads and layer_idx == len(metadata.sources) - 1:
            self._offload(pages, metadata.offloads)
        return output

    def _choose_pages(self, isa, query, pages, page_ids, token_idx, lengths, budgets) -> list[torch.Tensor]:
        """Eq. (3)-(4) and the page choice for decode rows: ``page_ids`` [rows, kv_heads, pages] in
        ``pages`` (one-head pages), ``token_idx`` the rows' query tokens."""
        block_size, width = pages.shape[-2:]
        keys = page_layout(isa, pages.dtype, block_size, width // 2).page_key_blocks(pages, page_ids)
        queries = query[token_idx].view(-1, self.num_heads, 1, self.head_size)
        chosen = select_pages(context_scores(queries, keys, lengths), lengths, block_size, budgets)
        WORKER_STATE.counters["context_pages"] += int((-(-lengths // block_size)).sum())
        WORKER_STATE.counters["selected_pages"] += sum(c.numel() for c in chosen)
        return chosen

    def _select(self, isa, query, kv_cache, context: ContextSelection) -> AttentionBatch:
        """Score each decode row's context with its last token (eq. 3-4) and build the sparse call over its pages."""
        heads, block_size = kv_cache.shape[1:3]
        lengths = context.seq_lens.long()
        num_pages = -(-lengths // block_size)
        table = context.block_table.long()[:, : int(num_pages.max())]
        page_ids = table[:, None, :] * heads + torch.arange(heads)[None, :, None]
        pages = self._one_head_pages(kv_cache)
        chosen = self._choose_pages(isa, query, pages, page_ids, context.token_idx, lengths, context.budgets)
        block_table = torch.zeros(len(chosen), max(c.numel() for c in chosen), dtype=context.block_table.dtype)
        for row, selected in enumerate(chosen):
            block_table[row, : selected.numel()] = table[row, selected].to(block_table.dtype)
        counts = torch.tensor([c.numel() for c in chosen])
        # Every page but the current (last) one is full: drop the tokens of the pages left out.
        seq_lens = (lengths - (num_pages - counts) * block_size).to(context.seq_lens.dtype)
        query_start_loc = torch.arange(len(chosen) + 1, dtype=torch.int32)
        return AttentionBatch(context.token_idx, query_start_loc, seq_lens, block_table, context.schedule(seq_lens, query_start_loc))

    def _select_offloaded(self, isa, query, pages, layer_idx: int, offloaded: OffloadedBatch) -> list[torch.Tensor]:
        """The filter layer's choice for offloaded rows, from its keys in the request's own pages."""
        batch = offloaded.full[layer_idx]
        heads = self.num_kv_heads
        page_ids = batch.block_table.long().view(len(offloaded.requests), heads, -1)
        lengths = torch.tensor([request.length for request in offloaded.requests])
        return self._choose_pages(isa, query, pages, page_ids, offloaded.token_idx, lengths, offloaded.budgets)

    def _load_selection(self, pages, layer_idx: int, offloaded: OffloadedBatch, chosen) -> AttentionBatch:
        """Copy a sparse layer's selected pages from the host pool into staging; the call that reads them."""
        calls = [request.sparse_call(layer_idx, rows_pages.tolist()) for request, rows_pages in zip(offloaded.requests, chosen)]
        loads = PageCopies.cat([call.loads for call in calls])
        WORKER_STATE.counters["loaded_kv_pages"] += loads.apply(WORKER_STATE.host.pages, pages.flatten(1))
        heads = self.num_kv_heads
        table = padded_table([pages for call in calls for pages in call.table])
        seq_lens = torch.tensor([call.seq_len for call in calls], dtype=torch.int32).repeat_interleave(heads)
        query_start_loc = torch.arange(len(calls) * heads + 1, dtype=torch.int32)
        return AttentionBatch(
            offloaded.token_idx, query_start_loc, seq_lens, table, offloaded.schedule(seq_lens, query_start_loc)
        )

    def _offload(self, pages, offloads: list[OffloadPlan]) -> None:
        """After the last layer: sparse layers' completed pages to the host, then the rest packed into
        the blocks each request keeps (every source read before any destination is written)."""
        flat = pages.flatten(1)
        for plan in offloads:
            WORKER_STATE.counters["offloaded_kv_pages"] += plan.to_host.apply(flat, WORKER_STATE.host.pages)
            plan.on_device.apply(flat, flat)
            WORKER_STATE.counters["offloaded_requests"] += 1

    def _add_attention(self, isa, query, kv_cache, layer_idx: int, per_head: PerHeadBatch) -> None:
        """Add each relocated request's new token's attention weights over its cache to its carried scores.

        The fused kernel returns no weights; the cache is budget-sized, so
        recomputing them is one small batched product per layer: the keys
        are read back through the per-head block tables just attended.
        """
        if per_head.token_idx.numel() != len(per_head.req_ids):
            raise RuntimeError("policies that accumulate attention take one new token per request and step")
        batch = per_head.layers[layer_idx]
        num_blocks, heads, block_size, width = kv_cache.shape
        lengths = batch.seq_lens.long()
        table = batch.block_table.long()[:, : -(-int(lengths.max()) // block_size)]
        layout = page_layout(isa, kv_cache.dtype, block_size, width // 2)
        keys = layout.page_keys(kv_cache, table)
        by_kv_head = (-1, self.num_kv_heads, self.num_queries_per_kv, self.head_size)
        queries = query.view(by_kv_head)[per_head.token_of, per_head.head_of]
        weights = new_token_attention(keys, lengths, queries)
        for i, req_id in enumerate(per_head.req_ids):
            carried = WORKER_STATE.carried[req_id]
            rows = weights[i * heads : (i + 1) * heads, : int(lengths[i * heads])]
            carried.scores[layer_idx] = add_new_token(carried.scores[layer_idx], rows)

    def _relocate(self, layer, query, kv_cache, relocations: list[Relocation]) -> None:
        """Move each finished prompt of this layer into per-head pages, keeping what the policy keeps.

        A policy whose layer budgets depend on every layer only observes here;
        the last layer then compresses every layer of the prompt.
        """
        layer_idx = layer_index(layer.layer_name)
        num_layers = relocations[0].pages.num_layers
        policy = WORKER_STATE.policy
        for relocation in relocations:
            if relocation.num_tokens is None:
                self._evict(layer.isa, kv_cache, layer_idx, relocation)
                continue
            queries = None
            if policy.needs_window or policy.needs_queries:
                queries = WORKER_STATE.take_window(relocation.req_id, layer_idx, query[relocation.window_idx])
            prompt = self._prompt(layer.isa, kv_cache, layer_idx, relocation, queries)
            counts = relocation.num_tokens, relocation.num_computed
            if not policy.budgets_across_layers:
                self._compact(layer.isa, kv_cache, layer_idx, relocation, prompt, relocation.budget, None, *counts)
                continue
            observed = WORKER_STATE.observe(relocation.req_id, layer_idx, kv_cache, policy.observe(prompt))
            if layer_idx == num_layers - 1:
                caches, observations = zip(*(observed[i] for i in range(num_layers)))
                budgets = policy.layer_budgets(list(observations), relocation.budget)
                for i, (cache, observation, budget) in enumerate(zip(caches, observations, budgets)):
                    earlier = prompt if i == layer_idx else self._prompt(layer.isa, cache, i, relocation, None)
                    self._compact(layer.isa, cache, i, relocation, earlier, budget, observation, *counts)

    def _evict(self, isa, kv_cache, layer_idx: int, relocation: Relocation) -> None:
        """An eviction pass: this layer's cache back to its budget, with what the policy carried, if over it."""
        pages = relocation.pages
        carried = WORKER_STATE.carried[relocation.req_id]
        length = int(pages.lengths[layer_idx, 0])
        budget = carried.budgets[layer_idx]
        if length <= budget:
            return
        keys, values = self._read(isa, kv_cache, layer_idx, pages, length)
        cache = PromptKV(
            keys,
            layer=layer_idx,
            num_layers=pages.num_layers,
            values=values,
            scores=carried.scores[layer_idx],
            threshold=carried.thresholds[layer_idx],
        )
        self._compact(isa, kv_cache, layer_idx, relocation, cache, budget, None, length, length)

    @staticmethod
    def _read(isa, kv_cache, layer_idx: int, pages: RequestPages, num_tokens: int):
        """The first ``num_tokens`` of each head of one layer of a request: keys, values, [heads, n, head_dim]."""
        num_blocks, heads, block_size, width = kv_cache.shape
        layout = page_layout(isa, kv_cache.dtype, block_size, width // 2)
        slots = pages.current_slots(layer_idx, [torch.arange(num_tokens)] * heads)
        keys, values = layout.gather(kv_cache.view(num_blocks * heads, -1), slots)
        return keys.view(heads, num_tokens, -1), values.view(heads, num_tokens, -1)

    def _prompt(self, isa, kv_cache, layer_idx: int, relocation: Relocation, queries) -> PromptKV:
        """The prompt's K/V of one layer, read from the request's pages, with the queries the policy needs."""
        keys, values = self._read(isa, kv_cache, layer_idx, relocation.pages, relocation.num_tokens)
        policy = WORKER_STATE.policy
        return PromptKV(
            keys,
            window_queries=queries if policy.needs_window else None,
            layer=layer_idx,
            num_layers=relocation.pages.num_layers,
            queries=queries if policy.needs_queries else None,
            values=values,
        )

    @staticmethod
    def _compact(isa, kv_cache, layer_idx, relocation, prompt, budget, observation, num_tokens, num_computed):
        """Pack what the policy keeps of one layer into per-head pages; write back K/V it rewrote.

        The policy chooses among the first ``num_tokens``; the rest, up to
        ``num_computed``, are kept. A policy that evicts in decode carries
        the layer's budget, scores and threshold to its next pass.
        """
        num_blocks, heads, block_size, width = kv_cache.shape
        layout = page_layout(isa, kv_cache.dtype, block_size, width // 2)
        pages_view = kv_cache.view(num_blocks * heads, -1)
        pages = relocation.pages
        policy = WORKER_STATE.policy
        result = policy.compress(prompt, budget, observation)
        generated = torch.arange(num_tokens, num_computed)
        moves = pages.relocate(layer_idx, [torch.cat([kept, generated]) for kept in result.kept])
        k, v = layout.gather(pages_view, moves.src)
        layout.scatter(pages_view, moves.dst, k, v)
        if result.keys is not None:
            slots = pages.current_slots(layer_idx, [torch.arange(kept.numel()) for kept in result.kept])
            head_size = width // 2
            layout.scatter(pages_view, slots, result.keys.reshape(-1, head_size), result.values.reshape(-1, head_size))
        if policy.evicts_in_decode:
            carried = WORKER_STATE.carried.setdefault(relocation.req_id, CarriedState.empty(pages.num_layers))
            carried.budgets[layer_idx] = budget
            if result.scores is not None:
                # Output recomputed after a preemption has no scores yet.
                unseen = torch.zeros(heads, generated.numel(), dtype=torch.float64)
                carried.scores[layer_idx] = torch.cat([result.scores, unseen], dim=1)
            carried.thresholds[layer_idx] = result.threshold
