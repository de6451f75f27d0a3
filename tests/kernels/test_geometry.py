"""The GPU caches' geometries against addressing written here from each tensor's own shape: the kernels and
their references both address pages through ``PageGeometry.element_index``'s ints, so a wrong geometry
would pass every other kernel test."""

import pytest
import torch

from kvpolicy_triton import flat
from tests.kernels.paging import IMPLEMENTATIONS, make_cache

BLOCKS, KV_HEADS, HEAD_SIZE = 3, 2, 8


def rows_by_index(layout: str, cache: torch.Tensor, value: bool) -> torch.Tensor:
    """[pages * block_size, D]: K (or V) of every slot, page ``b * KV_HEADS + h``, read by tensor indexing."""
    if layout == "head_major":  # [blocks, kv_heads, bs, 2D]: K then V in a token's row
        half = cache[..., HEAD_SIZE:] if value else cache[..., :HEAD_SIZE]
        return half.reshape(-1, HEAD_SIZE)
    # split_kv: [blocks, 2, bs, kv_heads, D]
    return cache[:, int(value)].permute(0, 2, 1, 3).reshape(-1, HEAD_SIZE)


@pytest.mark.parametrize("layout", ["head_major", "split_kv"])
def test_element_index_reads_what_the_cache_tensor_holds(layout):
    cache, geom = make_cache(layout, BLOCKS, KV_HEADS, HEAD_SIZE, torch.float32)
    slots = torch.arange(BLOCKS * KV_HEADS * geom.block_size, device=cache.device)
    for value in (False, True):
        got = flat(cache)[geom.element_index(slots, value)]
        assert torch.equal(got, rows_by_index(layout, cache, value)), f"value={value}"


@pytest.mark.parametrize("layout", ["head_major", "split_kv"])
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_the_kernels_gather_what_the_cache_tensor_holds(ops, layout):
    cache, geom = make_cache(layout, BLOCKS, KV_HEADS, HEAD_SIZE, torch.float32, seed=1)
    slots = torch.randperm(BLOCKS * KV_HEADS * geom.block_size, generator=torch.Generator().manual_seed(2))
    slots = slots.to(device=cache.device, dtype=torch.int32)
    keys, values = IMPLEMENTATIONS[ops].gather_tokens(cache, geom, slots)
    assert torch.equal(keys, rows_by_index(layout, cache, False)[slots.long()])
    assert torch.equal(values, rows_by_index(layout, cache, True)[slots.long()])
