"""new_token_weights against its reference and against kvpolicy's H2O new_token_attention on the same keys."""

import math

import pytest
import torch

from kvpolicy.policies.h2o import new_token_attention
from kvpolicy_triton import flat, new_token_weights_reference
from tests.kernels.paging import DEVICE, DTYPES, IMPLEMENTATIONS, LAYOUTS, index, make_cache, shuffled_pages

# KV length of each (request, KV head): ragged per head, around page boundaries.
LENGTHS = [[1, 17, 33], [5, 16, 9], [33, 2, 24]]
QUERY_HEADS, HEAD_SIZE = 6, 32
# Both sides compute float32 logits from the same inputs, in different orders; weights are <= 1.
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_heads", [3, 2], ids=["G2", "G3"])
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_new_token_weights(ops, dtype, layout, kv_heads):
    bs = LAYOUTS[layout]
    pages = max(-(-n // bs) for row in LENGTHS for n in row) + 1
    seqs = [(r, h) for r in range(len(LENGTHS)) for h in range(kv_heads)]
    generator = torch.Generator().manual_seed(5)
    seqs = [seqs[i] for i in torch.randperm(len(seqs), generator=generator)]
    cache, geom = make_cache(layout, len(seqs) * pages, kv_heads, HEAD_SIZE, dtype)
    table = shuffled_pages(len(seqs) * pages * kv_heads)[: len(seqs) * pages].view(len(seqs), pages)
    query = torch.randn(len(LENGTHS), QUERY_HEADS, HEAD_SIZE, generator=generator).to(DEVICE, dtype)
    token_of, head_of = index([r for r, _ in seqs]), index([h for _, h in seqs], torch.int64)
    seq_lens = index([LENGTHS[r][h] for r, h in seqs])
    args = (query, cache, geom, token_of, head_of, index(table), seq_lens, 1 / math.sqrt(HEAD_SIZE), kv_heads)

    got = IMPLEMENTATIONS[ops].new_token_weights(*args)
    want = new_token_weights_reference(*args)
    assert got.dtype == torch.float32 and got.shape == (len(seqs), pages * bs)
    torch.testing.assert_close(got, want, **TOLERANCE)

    width = torch.arange(pages * bs)
    slots = table[:, width // bs] * bs + width % bs
    keys = flat(cache)[geom.element_index(slots.flatten().to(DEVICE))].view(len(seqs), pages * bs, HEAD_SIZE)
    group = QUERY_HEADS // kv_heads
    queries = torch.stack([query[r, h * group : (h + 1) * group] for r, h in seqs])
    h2o = new_token_attention(keys.cpu(), seq_lens.cpu(), queries.cpu())
    torch.testing.assert_close(got.cpu().double(), h2o, **TOLERANCE)
