"""``KVOps`` on vLLM's CPU kernels (attention, cache writer) and kvpolicy's C++ ops (``csrc/``).

Inside a page the CPU writer packs tokens for its ISA; ``page_layout`` discovers where from the writer itself. On the
``vec`` ISAs that packing is affine (K transposed), and the C++ ops read and move tokens in place through its
``PageGeometry``: token moves, new-token weights (H2O/D2O), OmniKV's context attention, PoD's shared attention, and the
prompt's attention column sums. An ISA that packs otherwise (logged once) moves tokens through the discovered offsets,
and its attention ops run the same C++ ops on an affine copy of the pages a call reads (``affine_pages``): each op's
math has one implementation on this platform, whatever the ISA.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from kvpolicy.paging import PageLayout
from kvpolicy.vllm.internals import envs, ops
from kvpolicy.vllm.worker.ops.base import KVOps
from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows
from kvpolicy_triton.geometry import PageGeometry

try:
    import kvpolicy_csrc
except ImportError as error:  # the wheel was installed without its C++ half
    raise ImportError(
        f"kvpolicy's C++ CPU ops (csrc/) are not importable ({error}). Build them into this environment: "
        "`make install` in the kvpolicy checkout, or `pip install --no-build-isolation ./csrc` (needs g++ "
        "and the torch installed here)"
    ) from error

logger = logging.getLogger(__name__)


def one_head_pages(cache: torch.Tensor) -> torch.Tensor:
    """A cache as one-head pages [pages, 1, block_size, 2*head_size]: page ``b*H + h`` (contiguous on CPU)."""
    return cache.view(-1, 1, *cache.shape[2:])


def split_kv(cache: torch.Tensor):
    """K and V halves of a cache [blocks, heads, block_size, 2*head_size], as the CPU ops take them."""
    num_blocks, num_kv_heads, block_size, width = cache.shape
    return cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)


def by_head(tensor: torch.Tensor, rows: HeadRows, kv_heads: int, row_shape: tuple[int, ...]) -> torch.Tensor:
    """A per-token tensor [T, kv_heads * prod(row_shape)] as per-virtual-token rows [n, *row_shape].

    A whole batch's rows need no gather: a view of ``tensor`` where its strides allow, else one copy.
    """
    if rows.whole_batch:
        count = rows.token_of.numel()
        return tensor[: count // kv_heads].reshape(count, *row_shape)
    return tensor.reshape(-1, kv_heads, *row_shape)[rows.token_of, rows.head_of]


@functools.cache
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


def cache_layout(layer, cache: torch.Tensor) -> PageLayout:
    block_size, width = cache.shape[-2:]
    return page_layout(layer.isa, cache.dtype, block_size, width // 2)


def cpu_geometry(layout: PageLayout, cache: torch.Tensor) -> PageGeometry | None:
    """The ``PageGeometry`` of a CPU cache [blocks, h, block_size, 2*head_size] whose pages are packed as
    ``layout`` says, or None when that packing is not affine (then only the offset tables describe it)."""
    keys, values = layout.affine_keys, layout.affine_values
    if keys is None or values is None:
        return None
    heads, block_size, width = cache.shape[1:]
    page_elems = block_size * width
    return PageGeometry(block_size, width // 2, heads, heads * page_elems, page_elems, *keys, *values)


def affine_pages(
    layout: PageLayout, one_head: torch.Tensor, *tables: torch.Tensor
) -> tuple[torch.Tensor, PageGeometry, list[torch.Tensor]]:
    """The one-head pages that ``tables`` name (-1: none), copied out of ``one_head`` (pages packed as
    ``layout`` says) into a new head-major cache [pages, 1, block_size, 2*head_size], its geometry, and
    ``tables`` renumbered into it: what the C++ ops read where the packing is not affine."""
    used = torch.cat([table.reshape(-1) for table in tables]).long()
    used = used[used >= 0].unique()
    bs = layout.block_size
    keys, values = layout.gather(one_head, (used[:, None] * bs + torch.arange(bs)).reshape(-1))
    pages = torch.cat([keys, values], dim=-1).view(used.numel(), 1, bs, 2 * layout.head_size)
    number = torch.full((int(used.max()) + 1 if used.numel() else 1,), -1, dtype=torch.long)
    number[used] = torch.arange(used.numel())
    renumbered = [torch.where(table >= 0, number[table.long().clamp(min=0)], table.long()) for table in tables]
    return pages, PageGeometry.head_major(pages), renumbered


@functools.cache
def _log_torch_path(isa: str) -> None:
    logger.warning(
        "vLLM's CPU ISA %r packs KV pages non-affinely: kvpolicy's C++ ops cannot address them in place, "
        "token moves take the slower torch path and attention ops read a copy of their pages",
        isa,
    )


@dataclass(frozen=True)
class CacheViews:
    """What the CPU kernels take of one cache tensor: its K/V halves, as vLLM's blocks and as one-head
    pages, and the C++ ops' geometry (None: not affine). Made once per tensor, since a layer passes
    the same cache every step and these views cost more than a decode step's write."""

    key: torch.Tensor
    value: torch.Tensor
    one_head: torch.Tensor
    one_head_key: torch.Tensor
    one_head_value: torch.Tensor
    geometry: PageGeometry | None

    @classmethod
    def of(cls, layer, cache: torch.Tensor) -> CacheViews:
        one_head = one_head_pages(cache)
        return cls(*split_kv(cache), one_head, *split_kv(one_head), cpu_geometry(cache_layout(layer, cache), cache))


class CPUOps(KVOps):
    """vLLM's CPU attention (each layer's impl settings: scale, sinks, soft cap, ...) and cache writer.

    ``builder``: vLLM's CPU metadata builder, whose settings the scheduler
    metadata of each call needs.
    """

    sums_prompts = True

    def __init__(self, builder=None):
        self.builder = builder
        self._views: dict[int, tuple[torch.Tensor, CacheViews]] = {}

    def views(self, layer, cache: torch.Tensor) -> CacheViews:
        """``cache``'s views, from the first call with this tensor (held here, so no other tensor takes its id)."""
        held = self._views.get(id(cache))
        if held is None:
            held = self._views[id(cache)] = cache, CacheViews.of(layer, cache)
        return held[1]

    def plan(self, query_start_loc, seq_lens, block_table, kv_heads, queries_per_kv):
        b = self.builder
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(),
            num_heads=kv_heads * queries_per_kv,
            num_kv_heads=kv_heads,
            head_dim=b.head_dim,
            seq_lens=seq_lens,
            dtype=b.dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=b.window_size,
            isa=b.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=b.kv_cache_dtype,
        )

    def write(self, layer, cache, key, value, rows, slots):
        impl = layer.impl
        row_shape = (1, impl.head_size)
        views = self.views(layer, cache)
        ops.cpu_attn_reshape_and_cache(
            by_head(key, rows, impl.num_kv_heads, row_shape),
            by_head(value, rows, impl.num_kv_heads, row_shape),
            views.one_head_key,
            views.one_head_value,
            slots,
            layer.isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=impl.kv_cache_dtype,
        )

    def _call(self, layer, query, output, key_cache, value_cache, batch: AttentionBatch) -> None:
        impl = layer.impl
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=output,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            scale=impl.scale,
            causal=True,
            alibi_slopes=impl.alibi_slopes,
            sliding_window=impl.sliding_window,
            block_table=batch.block_table,
            softcap=impl.logits_soft_cap,
            scheduler_metadata=batch.plan,
            s_aux=impl.sinks,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=impl.kv_cache_dtype,
        )

    def attend(self, layer, query, out, cache, batch, rows=None):
        if batch.kv_heads > 1:
            count = batch.token_idx.numel()
            if not count:
                return
            views = self.views(layer, cache)
            if batch.in_order:
                self._call(layer, query[:count], out[:count], views.key, views.value, batch)
                return
            rows_out = torch.empty_like(query[batch.token_idx])
            self._call(layer, query[batch.token_idx], rows_out, views.key, views.value, batch)
            out[batch.token_idx] = rows_out
            return
        impl = layer.impl
        views = self.views(layer, cache)
        row_shape = (impl.num_queries_per_kv, impl.head_size)
        head_query = by_head(query, rows, impl.num_kv_heads, row_shape)
        head_cache = views.one_head_key, views.one_head_value
        if rows.whole_batch:  # the kernel writes ``out`` in place
            self._call(layer, head_query, out[: batch.token_idx.numel()].view(-1, *row_shape), *head_cache, batch)
            return
        head_out = torch.empty_like(head_query)
        self._call(layer, head_query, head_out, *head_cache, batch)
        out.view(-1, impl.num_kv_heads, *row_shape)[rows.token_of, rows.head_of] = head_out

    def _geometry(self, layer, cache) -> PageGeometry | None:
        geometry = self.views(layer, cache).geometry
        if geometry is None:
            _log_torch_path(layer.isa)
        return geometry

    def gather(self, layer, cache, slots):
        geometry = self._geometry(layer, cache)
        if geometry is not None:
            return kvpolicy_csrc.gather_tokens(cache, geometry, slots)
        return cache_layout(layer, cache).gather(self.views(layer, cache).one_head.view(-1), slots)

    def gather_values(self, layer, cache, slots):
        geometry = self._geometry(layer, cache)
        if geometry is not None:
            return kvpolicy_csrc.gather_values(cache, geometry, slots)
        return super().gather_values(layer, cache, slots)

    def scatter(self, layer, cache, slots, keys, values):
        geometry = self._geometry(layer, cache)
        if geometry is not None:
            kvpolicy_csrc.scatter_tokens(cache, geometry, slots, keys, values)
            return
        cache_layout(layer, cache).scatter(self.views(layer, cache).one_head.view(-1), slots, keys, values)

    def move(self, layer, cache, src, dst):
        geometry = self._geometry(layer, cache)
        if geometry is not None:
            kvpolicy_csrc.move_tokens(cache, geometry, src, dst)
            return
        super().move(layer, cache, src, dst)

    def prompt_column_sums(self, keys, queries):
        return kvpolicy_csrc.attention_column_sums(keys, queries, 1 / math.sqrt(keys.shape[-1]))

    def prompt_attention(self, layer, query, out, cache, chunk):
        heads, length = chunk.slots.shape
        keys, values = self.gather(layer, cache, chunk.slots.reshape(-1))
        queries = query[chunk.token_idx].transpose(0, 1)
        attended, sums = kvpolicy_csrc.prompt_attention(
            keys.view(heads, length, -1), values.view(heads, length, -1), queries, layer.impl.scale
        )
        out[chunk.token_idx] = attended.transpose(0, 1).to(out.dtype)
        return sums

    def _addressed(self, layer, cache, *tables: torch.Tensor):
        """``cache``, its geometry and ``tables``, as the C++ ops read them: in place where the pages are
        affine, else a copy of the pages the tables name (``affine_pages``)."""
        geometry = self._geometry(layer, cache)
        if geometry is not None:
            return cache, geometry, tables
        return affine_pages(cache_layout(layer, cache), self.views(layer, cache).one_head, *tables)

    def pod_attention(self, layer, query, out, cache, call):
        impl = layer.impl
        token_of, head_of, page_table, seq_lens, value_table, *distant = call.indices()
        pages, geometry, (page_table, value_table) = self._addressed(layer, cache, page_table, value_table)
        indices = (token_of, head_of, page_table, seq_lens, value_table, *distant)
        return kvpolicy_csrc.pod_attention(
            query, out, pages, geometry, *indices, call.distant_logits, impl.scale, impl.num_kv_heads, call.tau
        )

    def new_token_weights(self, layer, query, cache, batch, rows):
        """The fused kernel returns no weights: the C++ op recomputes them from the keys."""
        impl = layer.impl
        pages, geometry, (table,) = self._addressed(layer, cache, batch.block_table)
        args = (rows.token_of, rows.head_of, table, batch.seq_lens, impl.scale, impl.num_kv_heads)
        return kvpolicy_csrc.new_token_weights(query, pages, geometry, *args).double()

    def context_attention(self, layer, query, out, cache, page_ids, token_idx, lengths):
        pages, geometry, (page_ids,) = self._addressed(layer, cache, page_ids)
        return kvpolicy_csrc.context_attention(
            query, out, pages, geometry, token_idx, page_ids, lengths, layer.impl.scale
        )
