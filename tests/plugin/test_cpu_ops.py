"""The CPU ops where vLLM's ISA packs pages non-affinely: the C++ ops read a copy of the pages a call names
(``affine_pages``) and compute exactly what they compute over the same tokens laid out affinely."""

import math

import pytest
import torch

import kvpolicy_csrc
from kvpolicy.paging import PageLayout
from kvpolicy.vllm.worker.ops.cpu import affine_pages
from kvpolicy_triton import PageGeometry

BLOCKS, KV_HEADS, QUERY_HEADS, BS, D = 7, 2, 4, 8, 16
LENGTHS = [20, 13, 1]  # tokens of each row: over three pages, two, one


@pytest.fixture(scope="module")
def caches():
    """A head-major cache [blocks, kv_heads, bs, 2D], and the same tokens in pages whose elements are
    shuffled (one permutation for every page): that packing's layout is not affine."""
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(BLOCKS, KV_HEADS, BS, 2 * D, generator=generator)
    page = 2 * BS * D
    shuffle = torch.randperm(page, generator=generator)
    token, dim = torch.arange(BS)[:, None], torch.arange(D)
    layout = PageLayout(BS, D, shuffle[token * 2 * D + dim], shuffle[token * 2 * D + D + dim])
    assert layout.affine_keys is None and layout.affine_values is None
    packed = torch.empty(BLOCKS * KV_HEADS, page)
    packed[:, shuffle] = cache.view(-1, page)
    return cache, layout, packed


def one_head_page_ids(blocks: list[list[int]]) -> torch.Tensor:
    """[rows, kv_heads, pages]: each row's blocks as the one-head pages of every KV head."""
    return torch.tensor(blocks)[:, None, :] * KV_HEADS + torch.arange(KV_HEADS)[None, :, None]


PAGE_IDS = one_head_page_ids([[5, 2, 6], [0, 3, 3], [4, 4, 4]])


def test_the_copy_holds_the_tokens_the_tables_name_and_renumbers_them(caches):
    cache, layout, packed = caches
    table = torch.tensor([[3, -1, 11], [7, 3, -1]], dtype=torch.int32)
    pages, geometry, (renumbered, ids) = affine_pages(layout, packed, table, PAGE_IDS)
    named = torch.cat([table.reshape(-1), PAGE_IDS.reshape(-1)])
    assert pages.shape == (named[named >= 0].unique().numel(), 1, BS, 2 * D)
    assert torch.equal(renumbered < 0, table < 0), "no page stays no page"
    for before, after in ((table, renumbered), (PAGE_IDS, ids)):
        before, after = before[before >= 0].long(), after[after >= 0]
        slots = (before[:, None] * BS + torch.arange(BS)).reshape(-1)
        moved = (after[:, None] * BS + torch.arange(BS)).reshape(-1)
        want = kvpolicy_csrc.gather_tokens(cache, PageGeometry.head_major(cache), slots)
        got = kvpolicy_csrc.gather_tokens(pages, geometry, moved)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))


def test_context_attention_and_new_token_weights_read_the_copy_as_the_pages(caches):
    cache, layout, packed = caches
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(len(LENGTHS), QUERY_HEADS, D, generator=generator)
    token_idx, lengths, scale = torch.arange(len(LENGTHS)), torch.tensor(LENGTHS), 1 / math.sqrt(D)
    pages, geometry, (ids,) = affine_pages(layout, packed, PAGE_IDS)
    outs = torch.zeros_like(query), torch.zeros_like(query)
    want = kvpolicy_csrc.context_attention(
        query, outs[0], cache, PageGeometry.head_major(cache), token_idx, PAGE_IDS, lengths, scale
    )
    got = kvpolicy_csrc.context_attention(query, outs[1], pages, geometry, token_idx, ids, lengths, scale)
    assert outs[0].abs().sum() > 0
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    # New-token weights: one sequence per (row, KV head), over that head's pages.
    token_of = torch.arange(len(LENGTHS)).repeat_interleave(KV_HEADS)
    head_of = torch.arange(KV_HEADS).repeat(len(LENGTHS))
    table, seq_lens = PAGE_IDS.reshape(-1, PAGE_IDS.shape[2]), lengths.repeat_interleave(KV_HEADS)
    pages, geometry, (renumbered,) = affine_pages(layout, packed, table)
    args = (token_of, head_of)
    want = kvpolicy_csrc.new_token_weights(
        query, cache, PageGeometry.head_major(cache), *args, table, seq_lens, scale, KV_HEADS
    )
    got = kvpolicy_csrc.new_token_weights(query, pages, geometry, *args, renumbered, seq_lens, scale, KV_HEADS)
    assert want[0, : LENGTHS[0]].sum().item() == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
