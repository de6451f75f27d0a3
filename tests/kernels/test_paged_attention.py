"""Paged attention against its loop reference: decode and prompt chunks in one call, per-head ragged lengths, GQA."""

import math

import pytest
import torch

from kvpolicy_triton import TARGET_PROGRAMS, decode_workspace, paged_attention, paged_attention_reference
from tests.kernels.paging import DEVICE, DTYPES, LAYOUTS, TOLERANCE, index, make_cache, shuffled_pages

# (new tokens, KV length of each KV head): decodes (1 new token) and chunks (causal inside the chunk).
REQUESTS = [(1, [17, 5, 33]), (4, [33, 9, 20]), (1, [1, 2, 16]), (5, [5, 8, 12])]
# Decodes long enough to be split along the keys and merged; a chunk longer than one query tile.
LONG_DECODES = [(1, [700, 1100, 90]), (1, [513, 64, 1030])]
LONG_CHUNK = [(80, [85, 80, 120]), (1, [30, 17, 5])]
QUERY_HEADS = 6


def build_batch(layout, kv_heads, head_size, dtype, skip=None, requests=REQUESTS):
    """A batch over ``requests``, one virtual sequence per (request, KV head) except ``skip``."""
    bs = LAYOUTS[layout]
    max_pages = max(-(-n // bs) for _, lens in requests for n in lens) + 1
    blocks = len(requests) * max_pages  # kv_heads pages each: room for every sequence's table
    cache, geom = make_cache(layout, blocks, kv_heads, head_size, dtype)
    pool = iter(shuffled_pages(blocks * kv_heads).tolist())
    token_of, head_of, starts, seq_lens, table = [], [], [0], [], []
    first_token = 0
    for r, (q_len, lens) in enumerate(requests):
        for h in range(kv_heads):
            if (r, h) == skip:
                continue
            token_of += range(first_token, first_token + q_len)
            head_of += [h] * q_len
            starts.append(starts[-1] + q_len)
            seq_lens.append(lens[h % len(lens)])
            table.append([next(pool) for _ in range(max_pages)])
        first_token += q_len
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(first_token, QUERY_HEADS, head_size, generator=generator).to(DEVICE, dtype)
    out = torch.full_like(query, 7.0)
    ints = dict(
        token_of=index(token_of),
        head_of=index(head_of),
        query_start_loc=index(starts),
        seq_lens=index(seq_lens),
        page_table=index(table, torch.int64),
    )
    return query, out, cache, geom, ints


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_heads", [3, 2], ids=["G2", "G3"])
def test_paged_attention_triton_matches_reference(dtype, layout, kv_heads):
    head_size = 32
    query, out, cache, geom, ints = build_batch(layout, kv_heads, head_size, dtype, skip=(1, 1))
    want = out.clone()
    args = dict(ints, scale=1 / math.sqrt(head_size), num_kv_heads=kv_heads)
    paged_attention(query, out, cache, geom, **args)
    paged_attention_reference(query, want, cache, geom, **args)
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])
    # The skipped (request, KV head) keeps its sentinel: the kernel writes only its own virtual tokens.
    group = QUERY_HEADS // kv_heads
    assert (out[1:5, group : 2 * group] == 7.0).all()


@pytest.mark.parametrize("head_size, kv_heads", [(16, 2), (64, 2), (80, 6), (128, 6)])
def test_paged_attention_triton_head_sizes(head_size, kv_heads):
    """Head sizes, powers of two or not, and G = 1 (six KV heads)."""
    query, out, cache, geom, ints = build_batch("head_major", kv_heads, head_size, torch.float32)
    want = out.clone()
    args = dict(ints, scale=1 / math.sqrt(head_size), num_kv_heads=kv_heads)
    paged_attention(query, out, cache, geom, **args)
    paged_attention_reference(query, want, cache, geom, **args)
    torch.testing.assert_close(out, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("requests", [LONG_DECODES, LONG_CHUNK], ids=["split_decodes", "long_chunk"])
def test_paged_attention_triton_long_sequences(requests, dtype):
    """Decodes over 512+ keys take the split-and-merge path; an 80-token chunk spans two query tiles."""
    kv_heads, head_size = 3, 32
    query, out, cache, geom, ints = build_batch("head_major", kv_heads, head_size, dtype, requests=requests)
    want = out.clone()
    args = dict(ints, scale=1 / math.sqrt(head_size), num_kv_heads=kv_heads)
    paged_attention(query, out, cache, geom, **args)
    paged_attention_reference(query, want, cache, geom, **args)
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])


def test_paged_attention_in_fixed_shapes_matches_reference():
    """A fixed-shape decode call (what a CUDA graph replays): the grid sized for the longest sequence the model
    allows rather than this batch's, the split states in a workspace kept between calls, and padded sequences
    of length 0, whose queries come out zero."""
    kv_heads, head_size = 3, 32
    requests = [*LONG_DECODES, (1, [0, 0, 0])]  # the last row: padding
    query, out, cache, geom, ints = build_batch("head_major", kv_heads, head_size, torch.float32, requests=requests)
    args = dict(ints, scale=1 / math.sqrt(head_size), num_kv_heads=kv_heads)
    workspace = decode_workspace(TARGET_PROGRAMS, QUERY_HEADS // kv_heads, head_size, DEVICE)
    want = out.clone()
    paged_attention(query, out, cache, geom, **args, max_query_len=1, max_seq_len=32768, workspace=workspace)
    paged_attention_reference(query, want, cache, geom, **args)
    torch.testing.assert_close(out[:2], want[:2], **TOLERANCE[torch.float32])
    assert (out[2] == 0).all()
