"""FlashAttention 3's paged varlen arguments against the Triton planner's virtual sequences, on CPU.

No GPU here: ``flash_semantics`` is what FlashAttention's paged varlen forward computes from its
arguments (K/V pages through the block table, ``seqused_k`` keys, causal from the bottom right), in
plain torch over the very views the call would receive. Its output must match kvpolicy's loop
reference (``paged_attention_reference``) over the planner's virtual sequences, in both physical
orders vLLM may allocate the cache in.
"""

import math

import pytest
import torch

from kvpolicy.vllm.worker.ops.flash_varlen import INDEX_DTYPE, flash_pages, flash_varlen_call
from kvpolicy.vllm.worker.ops.triton import plan_virtual_sequences
from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows
from kvpolicy_triton import PageGeometry, paged_attention_reference

KV_HEADS, GROUP, HEAD_SIZE, BLOCK_SIZE, BLOCKS = 2, 3, 16, 4, 12
Q_HEADS, SCALE = KV_HEADS * GROUP, 1 / math.sqrt(HEAD_SIZE)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # float32, as tests/kernels' kernels against the same reference


def make_cache(physical: str) -> torch.Tensor:
    """[blocks, kv_heads, block_size, 2 * head_size] in logical order; ``NHD``: a block's tokens interleave heads."""
    generator = torch.Generator().manual_seed(0)
    if physical == "HND":
        return torch.randn(BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=generator)
    return torch.randn(BLOCKS, BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE, generator=generator).transpose(1, 2)


def flash_semantics(q, key, value, cu_seqlens_q, seqused_k, block_table, scale) -> torch.Tensor:
    """FlashAttention's paged varlen forward, causal, from its arguments: q [rows, G, D], K/V [ids, page, 1, D]."""
    out = torch.empty_like(q)
    page_size = key.shape[1]
    for s in range(len(seqused_k)):
        first, end, n = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(seqused_k[s])
        keys_at = torch.arange(n)
        ids, offsets = block_table[s, keys_at // page_size].long(), keys_at % page_size
        k, v = key[ids, offsets, 0], value[ids, offsets, 0]
        logits = torch.einsum("mgd,nd->mgn", q[first:end], k) * scale
        position = n - (end - first) + torch.arange(end - first)  # the bottom-right causal mask
        logits = logits.masked_fill((keys_at[None, :] > position[:, None])[:, None, :], float("-inf"))
        out[first:end] = torch.einsum("mgn,nd->mgd", logits.softmax(dim=-1), v)
    return out


def attend_both_ways(cache, batch: AttentionBatch, rows: HeadRows | None, query, reference_args):
    """The call's output through FlashAttention's arguments, and the loop reference's, from the same sentinel."""
    pages = flash_pages(cache)
    call = flash_varlen_call(batch, rows, pages)
    q = call.queries(query, KV_HEADS)
    result = flash_semantics(q, pages.key, pages.value, call.cu_seqlens_q, call.seqused_k, call.block_table, SCALE)
    got = torch.full_like(query, 7.0)
    call.write(got, result, KV_HEADS)
    want = torch.full_like(query, 7.0)
    paged_attention_reference(query, want, cache, PageGeometry.head_major(cache), *reference_args, SCALE, KV_HEADS)
    return call, got, want


def check_arguments(call, sequences: int) -> None:
    """FlashAttention's checks: int32 contiguous indices of one shape per sequence."""
    for tensor in (call.cu_seqlens_q, call.seqused_k, call.block_table):
        assert tensor.dtype == INDEX_DTYPE and tensor.is_contiguous()
    assert call.cu_seqlens_q.shape == (sequences + 1,) and call.seqused_k.shape == (sequences,)
    assert call.block_table.shape[0] == sequences


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_pages_are_views_at_the_one_head_page_offsets(physical):
    cache = make_cache(physical)
    pages = flash_pages(cache)
    assert pages.key.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert pages.key.stride(-1) == pages.value.stride(-1) == 1
    assert pages.key.shape[1:] == (BLOCK_SIZE, 1, HEAD_SIZE)
    block, head = torch.meshgrid(torch.arange(BLOCKS), torch.arange(KV_HEADS), indexing="ij")
    ids = pages.page_ids((block * KV_HEADS + head).flatten()).long()
    torch.testing.assert_close(pages.key[ids, :, 0], cache[..., :HEAD_SIZE].flatten(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(pages.value[ids, :, 0], cache[..., HEAD_SIZE:].flatten(0, 1), rtol=0, atol=0)
    expected = block * KV_HEADS + head if physical == "HND" else block * BLOCK_SIZE * KV_HEADS + head
    assert torch.equal(ids, expected.flatten())


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_rows_in_vllm_layout(physical):
    """A prompt chunk and a decode in vLLM's blocks (the stock rows of a mixed step), among other batch tokens."""
    cache = make_cache(physical)
    query = torch.randn(9, Q_HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(1))
    token_idx = torch.tensor([1, 2, 3, 4, 5, 7])  # tokens 0, 6 and 8 belong to other calls
    query_start_loc = torch.tensor([0, 5, 6], dtype=torch.int32)
    seq_lens = torch.tensor([11, 14], dtype=torch.int32)
    block_table = torch.tensor([[5, 0, 9, 0], [3, 8, 1, 11]], dtype=torch.int32)
    plan = plan_virtual_sequences(query_start_loc, seq_lens, block_table, KV_HEADS, GROUP)
    batch = AttentionBatch(token_idx, query_start_loc, seq_lens, block_table, KV_HEADS, plan)
    reference = (token_idx[plan.local_token], plan.head_of, plan.query_start_loc, plan.seq_lens, plan.page_table)
    call, got, want = attend_both_ways(cache, batch, None, query, reference)
    check_arguments(call, 2 * KV_HEADS)
    assert call.max_seqlen_q == 5 and call.max_seqlen_k == 14
    torch.testing.assert_close(got, want, **TOLERANCE)
    assert (got[[0, 6, 8]] == 7.0).all()


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_one_head_sequences_with_their_own_lengths_and_pages(physical):
    """Relocated requests: every KV head on its own pages with its own length (a 3-token chunk, a decode)."""
    cache = make_cache(physical)
    query = torch.randn(5, Q_HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(2))
    rows = HeadRows(torch.tensor([0, 1, 2, 0, 1, 2, 4, 4]), torch.tensor([0, 0, 0, 1, 1, 1, 0, 1]))
    query_start_loc = torch.tensor([0, 3, 6, 7, 8], dtype=torch.int32)
    seq_lens = torch.tensor([6, 13, 3, 9], dtype=torch.int32)
    pages = torch.tensor([[17, 2, 0, 0], [6, 23, 11, 12], [9, 0, 0, 0], [1, 20, 4, 0]], dtype=torch.int32)
    batch = AttentionBatch(
        torch.tensor([0, 1, 2, 4]),
        query_start_loc,
        seq_lens,
        pages,
        1,
        plan_virtual_sequences(query_start_loc, seq_lens, pages, 1, GROUP),
    )
    reference = (rows.token_of, rows.head_of, query_start_loc, seq_lens, pages)
    call, got, want = attend_both_ways(cache, batch, rows, query, reference)
    check_arguments(call, 4)
    assert call.max_seqlen_q == 3 and call.max_seqlen_k == 13
    torch.testing.assert_close(got, want, **TOLERANCE)
    assert (got[3] == 7.0).all()


def test_rows_expand_to_one_sequence_per_row_and_head_in_row_head_position_order():
    query_start_loc = torch.tensor([0, 5, 6, 6, 9], dtype=torch.int32)
    seq_lens = torch.tensor([11, 14, 3, 9], dtype=torch.int32)
    block_table = torch.tensor([[5, 0, 9, 0], [3, 8, 1, 11], [2, 0, 0, 0], [4, 6, 7, 0]], dtype=torch.int32)
    plan = plan_virtual_sequences(query_start_loc, seq_lens, block_table, KV_HEADS, GROUP)
    rows = [(row, head) for row in range(4) for head in range(KV_HEADS)]
    local = [t for row, _ in rows for t in range(int(query_start_loc[row]), int(query_start_loc[row + 1]))]
    heads = [head for row, head in rows for _ in range(int(query_start_loc[row + 1] - query_start_loc[row]))]
    assert plan.local_token.tolist() == local and plan.head_of.tolist() == heads
    assert plan.query_start_loc.tolist() == [0, 5, 10, 11, 12, 12, 12, 15, 18] and plan.max_query_len == 5
    assert plan.seq_lens.tolist() == [11, 11, 14, 14, 3, 3, 9, 9]
    assert plan.page_table[3].tolist() == [7, 17, 3, 23]


def test_a_call_without_queries_has_no_arguments():
    query_start_loc = torch.zeros(1, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    plan = plan_virtual_sequences(query_start_loc, empty, torch.zeros(0, 1, dtype=torch.int32), KV_HEADS, GROUP)
    batch = AttentionBatch(torch.zeros(0, dtype=torch.int64), query_start_loc, empty, empty, KV_HEADS, plan)
    assert flash_varlen_call(batch, None, flash_pages(make_cache("HND"))) is None
