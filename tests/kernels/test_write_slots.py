"""write_slots against its reference: shuffled rows and slots, GQA-free K/V views of a fused qkv, every layout."""

import pytest
import torch

from kvpolicy_triton import flat, write_slots, write_slots_reference
from tests.kernels.paging import DEVICE, DTYPES, LAYOUTS, index, make_cache


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_write_slots_triton_matches_reference(dtype, layout):
    kv_heads, head_size, tokens = 3, 32, 7
    cache, geom = make_cache(layout, 4, kv_heads, head_size, dtype)
    generator = torch.Generator().manual_seed(2)
    # Views of one [T, Hkv, 2D] tensor, as vLLM hands K and V split out of the fused projection.
    fused = torch.randn(tokens, kv_heads, 2 * head_size, generator=generator).to(DEVICE, dtype)
    key, value = fused[..., :head_size], fused[..., head_size:]
    pairs = torch.cartesian_prod(torch.arange(tokens), torch.arange(kv_heads))
    pairs = pairs[torch.randperm(len(pairs), generator=generator)][:17]
    total_slots = 4 * kv_heads * geom.block_size
    slots = torch.randperm(total_slots, generator=generator)[: len(pairs)]
    token_of, head_of, slots = index(pairs[:, 0]), index(pairs[:, 1], torch.int64), index(slots)

    want = cache.clone()
    write_slots(cache, geom, key, value, token_of, head_of, slots)
    write_slots_reference(want, geom, key, value, token_of, head_of, slots)
    assert torch.equal(cache, want)
    stored = flat(cache)
    assert torch.equal(stored[geom.element_index(slots)], key[token_of.long(), head_of])
    assert torch.equal(stored[geom.element_index(slots, value=True)], value[token_of.long(), head_of])


def test_write_slots_skips_negative_slots():
    """A padded row of a fixed-shape decode step has slot -1: nothing of it is written, as in vLLM's writer."""
    kv_heads, head_size = 2, 32
    cache, geom = make_cache("head_major", 4, kv_heads, head_size, torch.float32)
    key = torch.randn(3, kv_heads, head_size).to(DEVICE)
    token_of, head_of, slots = index([0, 1, 2]), index([0, 1, 0], torch.int64), index([5, -1, 9])
    want = cache.clone()
    write_slots(cache, geom, key, key, token_of, head_of, slots)
    write_slots_reference(want, geom, key, key, token_of, head_of, slots)
    assert torch.equal(cache, want)
    stored = flat(cache)
    assert torch.equal(stored[geom.element_index(slots[[0, 2]])], key[[0, 2], [0, 0]])
