"""FlashAttention 3's paged variable-length forward over kvpolicy's one-head pages: its arguments.

vLLM's CUDA wheel ships FlashAttention 3 for Hopper GPUs (``vllm.vllm_flash_attn.flash_attn_varlen_func``
with ``fa_version=3``). Its paged forward reads K and V as ``[pages, page_size, kv_heads, head_size]``
views with any strides but a unit last one, an int32 page table per sequence, each sequence's key count
(``seqused_k``) and query offsets (``cu_seqlens_q``), and masks causally from the bottom right: exactly
kvpolicy's one-head virtual sequences (``triton_kernels/paged_attention.py``) with ``kv_heads = 1`` and a
sequence's G query heads as its query heads.

One-head page (vLLM block ``b``, KV head ``h``) of a cache ``[blocks, kv_heads, block_size, 2 * head_size]``
starts at ``b * block_stride + h * head_stride`` whichever physical order vLLM allocated (HND: each page
contiguous; NHD, vLLM 0.32's default order: a block's tokens interleave its heads). Both strides are
multiples of ``step = gcd(block_stride, head_stride)``, so one strided view whose pages are ``step``
elements apart holds every one-head page, at id ``b * block_stride / step + h * head_stride / step``
(``b * H + h`` for HND, ``b * block_size * H + h`` for NHD, pages overlapping in the view but never in
what is read). FlashAttention thus reads the cache in place; what a call copies is the queries, gathered
into virtual-token order ``[rows, G, D]``, and its output, scattered back.

The Triton ops (``ops/triton.py``) call it for every ``attend`` in fp16/bf16 on compute capability 9.x when
vLLM's wheel carries it (``flash_attention``; ``choose_flash`` is the decision, tested on CPU), and keep
kvpolicy's Triton kernel for fp32, other GPUs and Triton's interpreter. The arguments are plain torch, tested
on CPU against the Triton planner's virtual sequences and, through the ops, with a stand-in for the kernel;
``benchmarks/gpu_kernels.py`` times the kernel beside Triton's on a GPU.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows
from kvpolicy_triton import PageGeometry

#: FlashAttention takes page ids, offsets and lengths as int32.
INDEX_DTYPE = torch.int32
#: The cache dtypes FlashAttention 3 attends; kvpolicy's Triton kernel takes the others (fp32).
FLASH_DTYPES = (torch.float16, torch.bfloat16)
#: The compute capability major version FlashAttention 3 is built for (Hopper).
FLASH_MAJOR = 9
#: Key splits of a fixed-shape call (vLLM's own default for the FlashAttention calls in its full CUDA graphs,
#: ``flash_attn_max_num_splits_for_cuda_graph``): a bound set at capture, so that the split buffers the kernel
#: allocates have one size at every replay; 0 (the kernel's own choice) elsewhere.
FIXED_SPLITS = 32

logger = logging.getLogger(__name__)


def choose_flash(capability: tuple[int, int] | None, unavailable: str | None) -> str | None:
    """Why FlashAttention 3 does not serve this device (None: it does): ``capability`` the CUDA device's
    (None: no CUDA device), ``unavailable`` why vLLM's wheel cannot load it (None: it can). The dtype is
    the call's (``FLASH_DTYPES``)."""
    if capability is None:
        return "no CUDA device (kvpolicy's Triton kernel, interpreted on CPU)"
    if capability[0] != FLASH_MAJOR:
        return f"compute capability {capability[0]}.{capability[1]}: vLLM's FlashAttention 3 runs on 9.x"
    return unavailable


@functools.cache
def flash_attention() -> Callable | None:
    """vLLM's ``flash_attn_varlen_func`` at ``fa_version=3`` for this process's CUDA device, or None (logged once,
    with why)."""
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    unavailable = None
    if capability is not None:
        try:
            from vllm.vllm_flash_attn import fa_version_unsupported_reason, flash_attn_varlen_func
        except ImportError as error:  # a CPU build of vLLM, or one whose FlashAttention does not load
            unavailable = f"vllm.vllm_flash_attn does not import: {error}"
        else:
            unavailable = fa_version_unsupported_reason(3)
    reason = choose_flash(capability, unavailable)
    if reason is not None:
        logger.info("kvpolicy's per-head attention: its Triton kernel (%s)", reason)
        return None
    logger.info("kvpolicy's per-head attention: FlashAttention 3 in fp16/bf16, its Triton kernel otherwise")
    return functools.partial(flash_attn_varlen_func, fa_version=3)


@dataclass(frozen=True)
class FlashPages:
    """A cache's one-head pages as FlashAttention's paged K and V: views ``[ids, block_size, 1, head_size]``
    of the cache's own storage, one-head page ``b * heads_per_block + h`` at id
    ``b * block_step + h * head_step``."""

    key: torch.Tensor
    value: torch.Tensor
    heads_per_block: int
    block_step: int
    head_step: int

    @property
    def same_ids(self) -> bool:
        """Whether FlashAttention's page ids are kvpolicy's (head-major pages: HND, vLLM's LBHNC layout, or one
        head per block), so that page tables pass as they are."""
        return self.block_step == self.heads_per_block and self.head_step == (self.heads_per_block > 1)

    def page_ids(self, pages: torch.Tensor) -> torch.Tensor:
        """FlashAttention's page ids of kvpolicy's one-head pages (int32, same shape)."""
        if self.same_ids:
            return pages.to(INDEX_DTYPE)
        pages = pages.long()
        block = torch.div(pages, self.heads_per_block, rounding_mode="floor")
        return (block * self.block_step + (pages % self.heads_per_block) * self.head_step).to(INDEX_DTYPE)


def flash_pages(cache: torch.Tensor) -> FlashPages:
    """``cache`` [blocks, kv_heads, block_size, 2 * head_size], any block, head and token strides, K then V
    along the last dimension with unit stride (vLLM's CUDA Triton cache)."""
    geom = PageGeometry.head_major(cache)
    if geom.k_dim_stride != 1:
        raise ValueError("FlashAttention reads K and V rows with a unit last stride; this cache has none")
    blocks, heads = cache.shape[0], geom.heads_per_block
    step = geom.block_stride if heads == 1 else math.gcd(geom.block_stride, geom.head_stride)
    block_step, head_step = geom.block_stride // step, (geom.head_stride // step if heads > 1 else 0)
    ids = (blocks - 1) * block_step + (heads - 1) * head_step + 1
    if ids > torch.iinfo(INDEX_DTYPE).max:
        raise ValueError(f"{ids} FlashAttention page ids do not fit its int32 page table")
    size = (ids, geom.block_size, 1, geom.head_size)
    stride = (step, geom.k_token_stride, geom.head_size, 1)
    base = cache.storage_offset()
    return FlashPages(
        key=cache.as_strided(size, stride, base + geom.k_offset),
        value=cache.as_strided(size, stride, base + geom.v_offset),
        heads_per_block=heads,
        block_step=block_step,
        head_step=head_step,
    )


@dataclass(frozen=True)
class FlashVarlenCall:
    """One attention call as FlashAttention's varlen arguments. Virtual token ``i`` (query row ``i`` of the
    call) is the G query heads of KV head ``head_of[i]`` of batch token ``token_of[i]``; sequence ``s``
    owns rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``, the last positions of its ``seqused_k[s]`` keys on
    pages ``block_table[s]`` (FlashAttention page ids)."""

    token_of: torch.Tensor
    head_of: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    def to(self, device: torch.device) -> FlashVarlenCall:
        moved = [
            t.to(device, non_blocking=True)
            for t in (self.token_of, self.head_of, self.cu_seqlens_q, self.seqused_k, self.block_table)
        ]
        return FlashVarlenCall(*moved, self.max_seqlen_q, self.max_seqlen_k)

    def queries(self, query: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """The call's queries [rows, G, D] gathered from ``query`` [T, q_heads, D] (a copy)."""
        return query.unflatten(1, (kv_heads, -1))[self.token_of, self.head_of]

    def write(self, out: torch.Tensor, result: torch.Tensor, kv_heads: int) -> None:
        """Scatter the call's output ``result`` [rows, G, D] into ``out`` [T, q_heads, D] at its rows only."""
        out.unflatten(1, (kv_heads, -1))[self.token_of, self.head_of] = result


def flash_varlen_call(batch: AttentionBatch, rows: HeadRows | None, pages: FlashPages) -> FlashVarlenCall | None:
    """The arguments of ``batch``, planned by the Triton ops (``plan_virtual_sequences``: rows in vLLM's
    layout become one sequence per (row, KV head), ordered row, head, position); ``rows``: the virtual
    tokens of a one-head call (``batch.kv_heads == 1``). None: the call has no query."""
    virtual = batch.plan
    if batch.kv_heads > 1:
        if not batch.token_idx.numel():
            return None
        token_of, head_of = batch.token_idx[virtual.local_token], virtual.head_of
        starts, seq_lens, table = virtual.query_start_loc, virtual.seq_lens, virtual.page_table
    else:
        token_of, head_of = rows.token_of, rows.head_of
        starts, seq_lens, table = batch.query_start_loc, batch.seq_lens, batch.block_table
    return FlashVarlenCall(
        token_of=token_of.long(),
        head_of=head_of.long(),
        cu_seqlens_q=starts.to(INDEX_DTYPE).contiguous(),
        seqused_k=seq_lens.to(INDEX_DTYPE).contiguous(),
        block_table=pages.page_ids(table).contiguous(),
        max_seqlen_q=virtual.max_query_len,
        max_seqlen_k=int(seq_lens.max()),
    )
