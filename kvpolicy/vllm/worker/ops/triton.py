"""``KVOps`` on kvpolicy's own Triton kernels (``triton_kernels/``, installed as ``kvpolicy_triton``).

The GPU backend's ops. On a CPU machine they run in Triton's interpreter
(``TRITON_INTERPRET=1``) over vLLM's CPU cache, which is how the GPU path is
tested end to end without a GPU. Kernels address the cache through a
``PageGeometry`` read off the real tensor: its strides on CUDA, the CPU
writer's discovered in-page layout on CPU. On a Hopper GPU, ``attend`` in
fp16/bf16 calls vLLM's FlashAttention 3 over the same pages instead
(``ops/flash_varlen.py``): decode rows, prompt chunks and the fixed-shape
decode step alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from kvpolicy.paging import stock_page_tables, virtual_tokens
from kvpolicy.vllm.worker.ops.base import KVOps
from kvpolicy.vllm.worker.ops.flash_varlen import (
    FIXED_SPLITS,
    FLASH_DTYPES,
    INDEX_DTYPE,
    FlashPages,
    flash_attention,
    flash_pages,
)
from kvpolicy.vllm.worker.ops.staging import StagedStep, copy_to
from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows, PerHeadBatch, step_tensors
from kvpolicy_triton import (
    MIN_SPLIT_KEYS,
    TARGET_PROGRAMS,
    PageGeometry,
    context_attention,
    decode_workspace,
    gather_tokens,
    gather_values,
    move_tokens,
    new_token_weights,
    paged_attention,
    pod_attention,
    scatter_tokens,
    write_slots,
)


@dataclass(frozen=True)
class VirtualSequences:
    """A call's one-head virtual sequences: the most tokens one of them brings (it sizes the kernel's
    grid), and, for rows in vLLM's layout (``kv_heads > 1``), their expansion into one sequence per
    (row, head): ``local_token`` indexes the call's own tokens (``AttentionBatch.token_idx``).
    A fixed-shape decode call (``TritonOps.fixed_decode_plan``) also fixes the longest sequence the grid
    is sized for and the split decode's ``workspace``, so its launches do not depend on the step."""

    max_query_len: int
    local_token: torch.Tensor | None = None
    head_of: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    max_seq_len: int | None = None
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None


def _max_query_len(query_start_loc: torch.Tensor) -> int:
    return int(np.diff(query_start_loc.numpy()).max()) if query_start_loc.numel() > 1 else 0


def plan_virtual_sequences(
    query_start_loc, seq_lens, block_table, kv_heads: int, queries_per_kv: int
) -> VirtualSequences:
    """The ``Planner`` of the Triton ops. Rows in vLLM's layout become ``kv_heads`` one-head sequences
    each (ordered row, head, position), over pages ``block * kv_heads + head``."""
    if kv_heads == 1 or query_start_loc.numel() == 1:
        return VirtualSequences(_max_query_len(query_start_loc))
    qsl = query_start_loc.long()
    counts = qsl[1:] - qsl[:-1]
    rows = counts.numel()
    virtual_counts = counts.repeat_interleave(kv_heads)
    virtual_qsl = torch.zeros(rows * kv_heads + 1, dtype=torch.int32)
    virtual_qsl[1:] = virtual_counts.cumsum(0)
    row, head, nth = virtual_tokens(counts.numpy(), kv_heads)
    return VirtualSequences(
        max_query_len=_max_query_len(virtual_qsl),
        local_token=torch.from_numpy(qsl.numpy()[row] + nth),
        head_of=torch.from_numpy(head),
        query_start_loc=virtual_qsl,
        seq_lens=seq_lens.repeat_interleave(kv_heads),
        page_table=stock_page_tables(block_table, kv_heads).to(torch.int32),  # one dtype with the per-head tables
    )


@dataclass(frozen=True)
class LayerCalls:
    """A step's per-head calls with their device arguments, made once when the step is staged: each layer's
    write and attention then look their arguments up instead of mapping five host tensors to the staged
    copy and reducing the layer's lengths to its longest sequence in every call of every layer.

    ``writes``: host address of a layer's slots -> (the rows they are for, the slots' shape, the write's
    device indices); ``attends``: id of a layer's call -> (the call, its rows, the device indices, its
    longest sequence)."""

    writes: dict[int, tuple[HeadRows, torch.Size, tuple[torch.Tensor, ...]]]
    attends: dict[int, tuple[AttentionBatch, HeadRows, tuple[torch.Tensor, ...], int]]

    @classmethod
    def of(cls, per_head: PerHeadBatch, staged: StagedStep) -> LayerCalls:
        rows = per_head.rows
        token_of, head_of, slots, seq_lens, tables = staged.to_device(
            [rows.token_of, rows.head_of, per_head.slots, per_head.seq_lens, per_head.tables]
        )
        host_slots = per_head.slots
        row_bytes = host_slots.stride(0) * host_slots.element_size()
        layer_shape = host_slots.shape[1:]
        writes = {
            host_slots.data_ptr() + layer * row_bytes: (rows, layer_shape, (token_of, head_of, layer_slots))
            for layer, layer_slots in enumerate(slots.unbind(0))
        }
        longest = per_head.seq_lens.numpy().max(axis=1).tolist()  # host lengths; numpy reduces them faster
        attends = {}
        host_qsl = qsl = None
        for batch, layer_lens, table, max_len in zip(per_head.layers, seq_lens.unbind(0), tables.unbind(0), longest):
            if batch.query_start_loc is not host_qsl:  # the builder gives every layer the same
                host_qsl = batch.query_start_loc
                (qsl,) = staged.to_device([host_qsl])
            attends[id(batch)] = (batch, rows, (token_of, head_of, qsl, layer_lens, table), max_len)
        return cls(writes, attends)

    def write(self, rows: HeadRows, slots: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        known = self.writes.get(slots.data_ptr())
        if known is None or known[0] is not rows or known[1] != slots.shape or slots.stride() != (1,):
            return None
        return known[2]

    def attend(self, batch: AttentionBatch, rows: HeadRows | None):
        """(device indices, longest sequence) of a per-head call of the step, or None."""
        known = self.attends.get(id(batch))
        if known is None or known[0] is not batch or known[1] is not rows:
            return None
        return known[2], known[3]


def cache_geometry(layer, cache: torch.Tensor) -> PageGeometry:
    """Where tokens lie in ``cache`` [n, h, block_size, 2*head_size]: its strides on a GPU; on CPU the
    cache writer's packing inside each contiguous page, which must be affine (the vec ISAs)."""
    if cache.is_cuda:
        return PageGeometry.head_major(cache)
    from kvpolicy.vllm.worker.ops.cpu import cache_layout, cpu_geometry

    geometry = cpu_geometry(cache_layout(layer, cache), cache)
    if geometry is None:
        raise RuntimeError(
            f"the Triton ops need an affine in-page layout; vLLM's CPU ISA {layer.isa!r} packs otherwise"
        )
    return geometry


class TritonOps(KVOps):
    """Kernels over any layer's cache (each layer's impl gives its scale and head counts). One per
    metadata builder: it stages each step it plans, and the attention layers that run the step read
    the staged copy through it (the step's path holds it).

    ``flash``: the FlashAttention 3 call ``attend`` makes in fp16/bf16 (``flash_attn_varlen_func``'s signature),
    by default ``flash_varlen.flash_attention()``: vLLM's on a compute capability 9.x GPU, None elsewhere."""

    def __init__(self, flash=None):
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "kvpolicy's Triton ops need a GPU; on a CPU machine they run only in Triton's interpreter "
                "(set TRITON_INTERPRET=1 before starting, for tests)"
            )
        self._heads_plan: tuple[torch.Tensor | None, VirtualSequences | None] = (None, None)
        #: The current step's index tensors on the device (``stage``).
        self.staged: StagedStep | None = None
        #: The current step's per-head calls with their device arguments (None: the step has none, or no
        #: layer asked yet), and the per-head batch they are made from (``_calls``).
        self.layer_calls: LayerCalls | None = None
        self._per_head: PerHeadBatch | None = None
        #: The side stream that loads OmniKV's selected pages from the host pool (made at its first load).
        self._copy_stream = None
        #: Where fixed-shape split decodes keep their partial states (``fixed_decode_plan``).
        self._workspace = None
        self.flash = flash if flash is not None else flash_attention()
        #: Each cache's pages as FlashAttention's K and V views, by the cache's address, shape and strides.
        self._flash_pages: dict[tuple, FlashPages] = {}

    @staticmethod
    def check_impl(impl) -> None:
        """Refuse an attention layer whose features the kernels do not implement."""
        unsupported = [
            name
            for name, value in (
                ("ALiBi", impl.alibi_slopes),
                ("attention sinks", getattr(impl, "sinks", None)),
                ("logit soft-capping", impl.logits_soft_cap),
            )
            if value
        ]
        if unsupported:
            raise NotImplementedError(f"kvpolicy's Triton attention does not implement {', '.join(unsupported)}")

    def stage(self, step, tables=None):
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        tensors = list(step_tensors(step))
        per_head = getattr(step, "per_head", None)
        self.layer_calls, self._per_head = None, None
        if per_head is None or tables is None:
            self.staged = StagedStep(tensors, device)
        else:
            self.staged, self._per_head = tables.stage(per_head.store, tensors, device), per_head

    def _on(self, device: torch.device, *tensors):
        """The step's index tensors are built on the host; kernels read them where the cache is: from the
        step's one staged copy (``stage``), or copied here when made after it."""
        staged = self.staged
        if staged is not None and staged.device == device:
            return staged.to_device(tensors)
        return copy_to(device, list(tensors))

    def _calls(self) -> LayerCalls | None:
        """The staged step's per-head calls with their device arguments, made at the first layer that asks (a
        fixed-shape decode step stages its per-head batch but its layers never ask)."""
        if self.layer_calls is None and self._per_head is not None:
            self.layer_calls = LayerCalls.of(self._per_head, self.staged)
        return self.layer_calls

    def _staged_call(self, batch: AttentionBatch, rows: HeadRows | None):
        """(device indices, longest sequence) of one of the staged step's per-head calls, or None."""
        calls = self._calls()
        return None if calls is None else calls.attend(batch, rows)

    def warm_up(self, layer, cache):
        """Every variant the engine launches (``kvpolicy_triton.launch``): paged attention in its decode
        tiling with and without splits over the keys, and in its chunk tiling; the cache write; token
        gathers, scatters and moves; a new token's weights; a filter layer's attention and page scores;
        PoD's attention. Over page 0's first tokens, before any request holds it."""
        impl, device = layer.impl, cache.device
        heads, size, scale = impl.num_kv_heads, impl.head_size, impl.scale
        geometry = cache_geometry(layer, cache)
        query = torch.zeros(2, heads * impl.num_queries_per_kv, size, dtype=cache.dtype, device=device)
        out = torch.empty_like(query)
        key = torch.zeros(2, heads, size, dtype=cache.dtype, device=device)
        token_of, head_of = (torch.zeros(n, dtype=torch.int64, device=device) for n in (2, 2))
        slots = torch.arange(2, dtype=torch.int64, device=device)
        write_slots(cache, geometry, key, key, token_of, head_of, slots)
        move_tokens(cache, geometry, slots, slots.flip(0))
        gather_values(cache, geometry, slots)
        long = 2 * MIN_SPLIT_KEYS  # a decode row this long is split over the keys
        table = torch.zeros(1, -(-long // geometry.block_size), dtype=torch.int32, device=device)
        for query_len, seq_len in ((1, 1), (1, long), (2, 2)):
            qsl = torch.tensor([0, query_len], dtype=torch.int32, device=device)
            lengths = torch.tensor([seq_len], dtype=torch.int32, device=device)
            paged_attention(
                query, out, cache, geometry, token_of[:query_len], head_of[:query_len], qsl, lengths, table, scale,
                heads, query_len, seq_len,
            )  # fmt: skip
        new_token_weights(query, cache, geometry, token_of[:1], head_of[:1], table, lengths, scale, heads)
        page_ids = torch.zeros(1, heads, 1, dtype=torch.int64, device=device)
        context_attention(query, out, cache, geometry, token_of[:1], page_ids, lengths.long(), scale)
        one = torch.zeros(1, dtype=torch.int32, device=device)
        none = torch.full((1,), -1, dtype=torch.int64, device=device)  # neither reads nor writes distant logits
        logits = torch.zeros(1, impl.num_queries_per_kv, 1, dtype=torch.float32, device=device)
        pod_attention(
            query, out, cache, geometry, token_of[:1], head_of[:1], table, lengths, table, one, one, none, none,
            logits, scale, heads,
        )  # fmt: skip

    def fixed_decode_plan(self, rows, max_seq_len, queries_per_kv, head_size, device):
        # One workspace for every padded size: the graphs replay one after another on one stream.
        if self._workspace is None:
            self._workspace = decode_workspace(TARGET_PROGRAMS, queries_per_kv, head_size, device)
        return VirtualSequences(max_query_len=1, max_seq_len=max_seq_len, workspace=self._workspace)

    def plan(self, query_start_loc, seq_lens, block_table, kv_heads, queries_per_kv):
        if kv_heads == 1 and self._heads_plan[0] is query_start_loc:
            return self._heads_plan[1]  # every layer's per-head call in a step: one query layout, one plan
        plan = plan_virtual_sequences(query_start_loc, seq_lens, block_table, kv_heads, queries_per_kv)
        if kv_heads == 1:
            self._heads_plan = (query_start_loc, plan)
        return plan

    def on_device(self, tensor, device):
        return self._on(device, tensor)[0]

    def write(self, layer, cache, key, value, rows: HeadRows, slots):
        calls = self._calls()
        indices = calls.write(rows, slots) if calls is not None else None
        if indices is None:
            indices = self._on(cache.device, rows.token_of, rows.head_of, slots)
        write_slots(cache, cache_geometry(layer, cache), key, value, *indices)

    def attend(self, layer, query, out, cache, batch: AttentionBatch, rows: HeadRows | None = None):
        virtual: VirtualSequences = batch.plan
        known = self._staged_call(batch, rows)
        if known is not None:
            indices, longest = known
        else:
            qsl, seq_lens, table = batch.query_start_loc, batch.seq_lens, batch.block_table
            if batch.kv_heads > 1:
                if not batch.token_idx.numel():
                    return
                token_of, head_of = batch.token_idx[virtual.local_token], virtual.head_of
                qsl, seq_lens, table = virtual.query_start_loc, virtual.seq_lens, virtual.page_table
            else:
                token_of, head_of = rows.token_of, rows.head_of
            indices = self._on(cache.device, token_of, head_of, qsl, seq_lens, table)
            longest = virtual.max_seq_len or int(seq_lens.max())
        if self.flash is not None and query.dtype in FLASH_DTYPES:
            self._flash_attend(layer, query, out, cache, virtual, rows, indices, longest)
            return
        impl = layer.impl
        paged_attention(
            query,
            out,
            cache,
            cache_geometry(layer, cache),
            *indices,
            impl.scale,
            impl.num_kv_heads,
            virtual.max_query_len,
            longest,
            virtual.workspace,
        )

    def pages_for_flash(self, cache: torch.Tensor) -> FlashPages:
        """``cache``'s one-head pages as FlashAttention's K and V views (made once per cache: a graph captures them)."""
        key = (cache.data_ptr(), tuple(cache.shape), cache.stride())
        pages = self._flash_pages.get(key)
        if pages is None:
            pages = self._flash_pages[key] = flash_pages(cache)
        return pages

    def _flash_attend(self, layer, query, out, cache, virtual: VirtualSequences, rows, indices, longest: int) -> None:
        """One call of FlashAttention's paged varlen forward over the call's one-head sequences (``kv_heads = 1``,
        a KV head's G query heads as its heads), reading the cache in place. A fixed-shape call passes its
        buffers' views as they are, with the longest sequence the model allows and ``FIXED_SPLITS``, so a graph
        replays it at any lengths; its padded sequences are 0 keys long and read nothing."""
        token_of, head_of, qsl, seq_lens, table = indices
        impl = layer.impl
        heads, group = impl.num_kv_heads, impl.num_queries_per_kv
        pages = self.pages_for_flash(cache)
        sequences = token_of.numel()
        in_place = rows is not None and rows.whole_batch  # every (token, head) of the first tokens, in order
        if in_place:
            tokens = sequences // heads
            q = query[:tokens].reshape(sequences, group, impl.head_size)
            target = out[:tokens].view(sequences, group, impl.head_size) if out[:tokens].is_contiguous() else None
        else:
            q = query.unflatten(1, (heads, group))[token_of, head_of]
            target = None
        result = self.flash(
            q,
            pages.key,
            pages.value,
            virtual.max_query_len,
            qsl.to(INDEX_DTYPE),
            longest,
            seqused_k=seq_lens.to(INDEX_DTYPE),
            softmax_scale=impl.scale,
            causal=True,
            block_table=pages.page_ids(table),
            out=target,
            num_splits=FIXED_SPLITS if virtual.max_seq_len is not None else 0,
        )
        if target is None:
            if in_place:
                out[:tokens] = result.view(tokens, heads * group, impl.head_size)
            else:
                out.unflatten(1, (heads, group))[token_of, head_of] = result

    def copy_pages(self, source, target, copies):
        if source.device == target.device:  # within vLLM's buffer: one gather and scatter, indices staged
            src, dst = self._on(target.device, copies.src, copies.dst)
            target[dst] = source[src]
            return copies.src.numel()
        # Between the pinned host pool and the device: a copy per page, queued without waiting.
        for src, dst in zip(copies.src.tolist(), copies.dst.tolist()):
            target[dst].copy_(source[src], non_blocking=True)
        return copies.src.numel()

    def load_pages(self, source, target, copies):
        if not target.is_cuda or not copies.src.numel():
            return super().load_pages(source, target, copies)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(target.device)
        # After everything the step queued so far (the flushes into the pool, last step's reads of the pages).
        self._copy_stream.wait_stream(torch.cuda.current_stream(target.device))
        with torch.cuda.stream(self._copy_stream):
            self.copy_pages(source, target, copies)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return done

    def wait_pages(self, pending):
        if pending is not None:
            torch.cuda.current_stream().wait_event(pending)

    def gather(self, layer, cache, slots):
        return gather_tokens(cache, cache_geometry(layer, cache), *self._on(cache.device, slots))

    def gather_values(self, layer, cache, slots):
        return gather_values(cache, cache_geometry(layer, cache), *self._on(cache.device, slots))

    def scatter(self, layer, cache, slots, keys, values):
        scatter_tokens(cache, cache_geometry(layer, cache), *self._on(cache.device, slots, keys, values))

    def move(self, layer, cache, src, dst):
        move_tokens(cache, cache_geometry(layer, cache), *self._on(cache.device, src, dst))

    def new_token_weights(self, layer, query, cache, batch, rows: HeadRows):
        known = self._staged_call(batch, rows)
        if known is None:
            indices = self._on(cache.device, rows.token_of, rows.head_of, batch.block_table, batch.seq_lens)
        else:
            token_of, head_of, _, seq_lens, table = known[0]
            indices = (token_of, head_of, table, seq_lens)
        geometry = cache_geometry(layer, cache)
        impl = layer.impl
        return new_token_weights(query, cache, geometry, *indices, impl.scale, impl.num_kv_heads).double()

    def context_attention(self, layer, query, out, cache, page_ids, token_idx, lengths):
        indices = self._on(cache.device, token_idx, page_ids, lengths)
        return context_attention(query, out, cache, cache_geometry(layer, cache), *indices, layer.impl.scale)

    def pod_attention(self, layer, query, out, cache, call):
        indices = self._on(cache.device, *call.indices())
        geometry = cache_geometry(layer, cache)
        impl = layer.impl
        return pod_attention(
            query, out, cache, geometry, *indices, call.distant_logits, impl.scale, impl.num_kv_heads, call.tau
        )
