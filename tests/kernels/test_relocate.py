"""gather/scatter/move_tokens against their references; moves whose sources and destinations overlap."""

import pytest
import torch

from kvpolicy_triton import (
    gather_tokens_reference,
    gather_values_reference,
    move_tokens_reference,
    scatter_tokens_reference,
)
from tests.kernels.paging import DEVICE, DTYPES, IMPLEMENTATIONS, LAYOUTS, index, make_cache

KV_HEADS, HEAD_SIZE, BLOCKS = 2, 32, 5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_gather_scatter_tokens_match_reference(ops, dtype, layout):
    cache, geom = make_cache(layout, BLOCKS, KV_HEADS, HEAD_SIZE, dtype)
    generator = torch.Generator().manual_seed(3)
    slots = index(torch.randperm(BLOCKS * KV_HEADS * geom.block_size, generator=generator)[:21], torch.int64)
    k, v = IMPLEMENTATIONS[ops].gather_tokens(cache, geom, slots)
    want_k, want_v = gather_tokens_reference(cache, geom, slots)
    assert k.dtype == cache.dtype and torch.equal(k, want_k) and torch.equal(v, want_v)
    values = IMPLEMENTATIONS[ops].gather_values(cache, geom, slots)
    assert torch.equal(values, gather_values_reference(cache, geom, slots)) and torch.equal(values, want_v)

    rows = torch.randn(2, len(slots), HEAD_SIZE, generator=generator).to(DEVICE, dtype)
    want = cache.clone()
    IMPLEMENTATIONS[ops].scatter_tokens(cache, geom, slots.int(), rows[0], rows[1])
    scatter_tokens_reference(want, geom, slots.int(), rows[0], rows[1])
    assert torch.equal(cache, want)


def compaction(geom, pages, generator):
    """Kept tokens scattered over ``pages`` packed, in order, into the first slots of the same pages."""
    slots = torch.cat([p * geom.block_size + torch.arange(geom.block_size) for p in pages])
    kept = slots[torch.rand(len(slots), generator=generator) < 0.6]
    return kept, slots[: len(kept)]


def permutation(geom, pages, generator):
    """Every token of ``pages`` moved to another slot of the same pages: each destination is also a source."""
    slots = torch.cat([p * geom.block_size + torch.arange(geom.block_size) for p in pages])
    return slots, slots[torch.randperm(len(slots), generator=generator)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("plan", [compaction, permutation], ids=lambda plan: plan.__name__)
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_move_tokens_overlapping(ops, dtype, layout, plan):
    cache, geom = make_cache(layout, BLOCKS, KV_HEADS, HEAD_SIZE, dtype)
    generator = torch.Generator().manual_seed(4)
    pages = torch.randperm(BLOCKS * KV_HEADS, generator=generator)[:3].tolist()
    src, dst = plan(geom, pages, generator)
    assert len(set(src.tolist()) & set(dst.tolist())) > 0
    src, dst = index(src), index(dst, torch.int64)
    before_k, before_v = gather_tokens_reference(cache, geom, src)

    want = cache.clone()
    IMPLEMENTATIONS[ops].move_tokens(cache, geom, src, dst)
    move_tokens_reference(want, geom, src, dst)
    assert torch.equal(cache, want)
    after_k, after_v = gather_tokens_reference(cache, geom, dst)
    assert torch.equal(after_k, before_k) and torch.equal(after_v, before_v)
