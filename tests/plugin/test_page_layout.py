"""The discovered in-page layout matches vLLM's CPU cache writer, exactly."""

import pytest
import torch

from kvpolicy.vllm.internals import CPU_ATTN_MODULE, ops
from kvpolicy.vllm.worker.ops.cpu import page_layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_gather_and_page_keys_read_what_reshape_and_cache_wrote(dtype, head_size):
    import importlib

    block_size, heads, blocks = 128, 3, 4
    isa = importlib.import_module(CPU_ATTN_MODULE)._get_attn_isa(dtype, block_size, head_size)
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(blocks * heads, 1, 2 * block_size, head_size).chunk(2, dim=2)
    n = 300
    slots = torch.randperm(blocks * heads * block_size)[:n]
    k = torch.randn(n, 1, head_size).to(dtype)
    v = torch.randn(n, 1, head_size).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    layout = page_layout(isa, dtype, block_size, head_size)
    got_k, got_v = layout.gather(cache.view(blocks * heads, -1), slots)
    assert torch.equal(got_k, k[:, 0]) and torch.equal(got_v, v[:, 0])
    pages = torch.tensor([[5, 2], [0, 11]])
    every = (pages[..., None] * block_size + torch.arange(block_size)).reshape(2, -1)
    whole = layout.page_keys(cache, pages)
    assert whole.shape == (2, 2 * block_size, head_size)
    assert torch.equal(
        whole, layout.gather(cache.view(blocks * heads, -1), every.reshape(-1))[0].view(2, -1, head_size)
    )


@pytest.mark.parametrize("row_shape", [(1, 16), (3, 16)])
def test_a_whole_batch_reads_the_same_rows_as_its_gather(row_shape):
    """``HeadRows.whole_batch`` (a reshape, no gather) reads exactly what the gather by (token, head) reads."""
    from kvpolicy.vllm.worker.ops.cpu import by_head
    from kvpolicy.vllm.worker.step import HeadRows

    tokens, heads, padded = 4, 3, 6  # vLLM may pad the batch past its tokens
    width = heads * row_shape[0] * row_shape[1]
    fused = torch.randn(padded, 2 * width + 5)  # a strided slice, like q/k/v split from one qkv tensor
    per_token = fused[:, 5 : 5 + width]
    token_of = torch.arange(tokens).repeat_interleave(heads)
    head_of = torch.arange(heads).repeat(tokens)
    gathered = by_head(per_token, HeadRows(token_of, head_of), heads, row_shape)
    whole = by_head(per_token, HeadRows(token_of, head_of, whole_batch=True), heads, row_shape)
    assert whole.shape == (tokens * heads, *row_shape)
    assert torch.equal(whole, gathered)
