"""context_page_scores against its reference and kvpolicy's OmniKV context_scores (window 1, "last") summed by page;
context_attention's output and scores against theirs."""

import math

import pytest
import torch

from kvpolicy.policies.omnikv import context_scores, page_sums
from kvpolicy_triton import context_attention_reference, context_page_scores_reference, flat
from tests.kernels import paging
from tests.kernels.paging import DEVICE, DTYPES, IMPLEMENTATIONS, LAYOUTS, index, make_cache, shuffled_pages

LENGTHS = [17, 1, 40, 8]
QUERY_HEADS, HEAD_SIZE = 6, 32
# Float32 logits from the same inputs on both sides, summed in different orders; weights are <= 1,
# a page's score the sum of at most block_size of them.
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_heads", [3, 2], ids=["G2", "G3"])
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_context_page_scores(ops, dtype, layout, kv_heads):
    bs = LAYOUTS[layout]
    rows = len(LENGTHS)
    pages = -(-max(LENGTHS) // bs) + 1
    cache, geom = make_cache(layout, rows * pages, kv_heads, HEAD_SIZE, dtype)
    page_ids = shuffled_pages(rows * pages * kv_heads)[: rows * pages * kv_heads].view(rows, kv_heads, pages)
    generator = torch.Generator().manual_seed(8)
    query = (2 * torch.randn(rows + 2, QUERY_HEADS, HEAD_SIZE, generator=generator)).to(DEVICE, dtype)
    token_idx = index(torch.randperm(rows + 2, generator=generator)[:rows])
    lengths = index(LENGTHS, torch.int64)
    args = (query, cache, geom, token_idx, index(page_ids), lengths, 1 / math.sqrt(HEAD_SIZE))

    got = IMPLEMENTATIONS[ops].context_page_scores(*args)
    assert got.dtype == torch.float64 and got.shape == (rows, pages)
    torch.testing.assert_close(got, context_page_scores_reference(*args), **TOLERANCE)

    # OmniKV multiplies in the keys' dtype; given float32 keys it is the same math as the kernel.
    width = torch.arange(pages * bs)
    slots = page_ids[..., width // bs] * bs + width % bs
    keys = flat(cache)[geom.element_index(slots.flatten().to(DEVICE))].view(rows, kv_heads, pages * bs, HEAD_SIZE)
    queries = query[token_idx.long()][:, :, None, :]
    omnikv = context_scores(queries.cpu().float(), keys.cpu().float(), lengths.cpu(), "last")
    torch.testing.assert_close(got.cpu(), page_sums(omnikv, bs), **TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("query_heads", [6, 10], ids=["G3", "G5"])
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_context_page_scores_on_vllm_cpu_pages(ops, dtype, query_heads):
    """vLLM's CPU pages (K transposed, 128 tokens): the C++ op reads them in register tiles of up to 4
    query heads (128 tokens for up to 3 heads with AVX-512, else 64); lengths end inside a tile, on a
    64-token tile's edge and on a page's."""
    kv_heads, bs, lengths = 2, 128, [300, 128, 70, 1, 64]
    rows, pages = len(lengths), 3
    cache, geom = make_cache("k_transposed", rows * pages, kv_heads, HEAD_SIZE, dtype, block_size=bs)
    page_ids = shuffled_pages(rows * pages * kv_heads).view(rows, kv_heads, pages)
    generator = torch.Generator().manual_seed(9)
    query = (2 * torch.randn(rows, query_heads, HEAD_SIZE, generator=generator)).to(DEVICE, dtype)
    args = (query, cache, geom, index(range(rows)), index(page_ids), index(lengths, torch.int64), HEAD_SIZE**-0.5)

    got = IMPLEMENTATIONS[ops].context_page_scores(*args)
    torch.testing.assert_close(got, context_page_scores_reference(*args), **TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_context_attention_writes_the_rows_attention_and_returns_their_page_scores(ops, dtype, layout):
    kv_heads, bs = 3, LAYOUTS[layout]
    rows = len(LENGTHS)
    pages = -(-max(LENGTHS) // bs) + 1
    cache, geom = make_cache(layout, rows * pages, kv_heads, HEAD_SIZE, dtype, seed=4)
    page_ids = shuffled_pages(rows * pages * kv_heads)[: rows * pages * kv_heads].view(rows, kv_heads, pages)
    generator = torch.Generator().manual_seed(10)
    query = (2 * torch.randn(rows + 2, QUERY_HEADS, HEAD_SIZE, generator=generator)).to(DEVICE, dtype)
    token_idx = index(torch.randperm(rows + 2, generator=generator)[:rows])
    args = (query, cache, geom, token_idx, index(page_ids), index(LENGTHS, torch.int64), 1 / math.sqrt(HEAD_SIZE))
    out = torch.full_like(query, 7.0)

    scores = IMPLEMENTATIONS[ops].context_attention(query, out, *args[1:])
    attended, expected_scores = context_attention_reference(*args)
    torch.testing.assert_close(scores, expected_scores, **TOLERANCE)
    torch.testing.assert_close(out[token_idx.long()].float(), attended, **paging.TOLERANCE[dtype])
    others = torch.ones(rows + 2, dtype=torch.bool, device=DEVICE)
    others[token_idx.long()] = False
    assert (out[others] == 7.0).all(), "rows outside token_idx untouched"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [64, 128, 80])
@pytest.mark.parametrize("query_heads", [6, 10], ids=["G3", "G5"])
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_context_attention_on_vllm_cpu_pages(ops, dtype, head_size, query_heads):
    """vLLM's CPU pages (128 tokens, V rows with adjacent dims): the C++ op keeps the weighted values of up
    to 4 query heads (64 dims) or 2 (128 dims) in registers, and any other head size takes the general
    path; lengths end inside a page and on its edge."""
    kv_heads, bs, lengths = 2, 128, [300, 128, 70, 1, 256]
    rows, pages = len(lengths), 3
    cache, geom = make_cache("k_transposed", rows * pages, kv_heads, head_size, dtype, seed=5, block_size=bs)
    page_ids = shuffled_pages(rows * pages * kv_heads).view(rows, kv_heads, pages)
    generator = torch.Generator().manual_seed(11)
    query = (2 * torch.randn(rows, query_heads, head_size, generator=generator)).to(DEVICE, dtype)
    args = (query, cache, geom, index(range(rows)), index(page_ids), index(lengths, torch.int64), head_size**-0.5)
    out = torch.zeros_like(query)

    scores = IMPLEMENTATIONS[ops].context_attention(query, out, *args[1:])
    attended, expected_scores = context_attention_reference(*args)
    torch.testing.assert_close(scores, expected_scores, **TOLERANCE)
    torch.testing.assert_close(out.float(), attended, **paging.TOLERANCE[dtype])
