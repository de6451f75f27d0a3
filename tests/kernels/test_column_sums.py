"""csrc's attention_column_sums against H2O's plain-torch attention_column_sums (its reference)."""

import math

import pytest
import torch

from kvpolicy.policies.h2o import attention_column_sums
from tests.kernels.paging import IMPLEMENTATIONS

pytestmark = pytest.mark.skipif("csrc" not in IMPLEMENTATIONS, reason="the C++ ops serve CPU caches")
# Both compute float32 logits and softmax from the same inputs (the GEMM sums in its own order) and
# add rows in float64 (csrc adds a tile's 32 rows in float32 first); a column sum is at most the count.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "kv_heads, q_heads, length, count",
    [(1, 1, 1, 1), (3, 9, 70, 70), (2, 4, 100, 33), (3, 3, 257, 200), (1, 2, 64, 1)],
    ids=["one-token", "prompt-G3", "last-33", "G1-tiles", "one-query"],
)
def test_attention_column_sums(dtype, kv_heads, q_heads, length, count):
    generator = torch.Generator().manual_seed(length)
    keys = (2 * torch.randn(kv_heads, length, 32, generator=generator)).to(dtype)
    queries = (2 * torch.randn(q_heads, count, 32, generator=generator)).to(dtype)
    got = IMPLEMENTATIONS["csrc"].attention_column_sums(keys, queries, 1 / math.sqrt(32))
    want = attention_column_sums(keys, queries)
    assert got.dtype == torch.float64 and got.shape == (q_heads, length)
    torch.testing.assert_close(got, want, **TOLERANCE)
    # Each query's weights sum to one.
    torch.testing.assert_close(got.sum(dim=1), torch.full((q_heads,), float(count), dtype=torch.float64))


def test_attention_column_sums_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        IMPLEMENTATIONS["csrc"].attention_column_sums(torch.randn(2, 8, 16), torch.randn(3, 8, 16), 0.25)
    with pytest.raises(RuntimeError, match="more queries"):
        IMPLEMENTATIONS["csrc"].attention_column_sums(torch.randn(1, 4, 16), torch.randn(1, 5, 16), 0.25)


def reference_prompt_attention(keys, values, queries, scale):
    """Causal softmax attention of the last ``count`` positions, GQA, in float64."""
    group, count, length = queries.shape[0] // keys.shape[0], queries.shape[1], keys.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=0) for t in (keys, values))
    logits = queries.double() @ k.transpose(1, 2) * scale
    future = torch.arange(length)[None, :] > torch.arange(length - count, length)[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


@pytest.mark.parametrize(
    "kv_heads, q_heads, length, count",
    [(1, 1, 1, 1), (3, 9, 70, 70), (2, 4, 100, 33), (3, 3, 257, 200)],
    ids=["one-token", "prompt-G3", "last-33", "G1-tiles"],
)
def test_prompt_attention(kv_heads, q_heads, length, count):
    """One QK^T for both: the attention output equals plain attention, the sums equal attention_column_sums."""
    generator = torch.Generator().manual_seed(length)
    keys, values = (2 * torch.randn(2, kv_heads, length, 32, generator=generator)).unbind(0)
    queries = 2 * torch.randn(q_heads, count, 32, generator=generator)
    out, sums = IMPLEMENTATIONS["csrc"].prompt_attention(keys, values, queries, 1 / math.sqrt(32))
    assert out.shape == (q_heads, count, 32) and out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), reference_prompt_attention(keys, values, queries, 1 / math.sqrt(32)), **TOLERANCE
    )
    torch.testing.assert_close(sums, attention_column_sums(keys, queries), **TOLERANCE)


def test_prompt_attention_sums_add_up_over_chunks():
    """The engine sums a prompt chunk by chunk (each chunk's queries over the keys so far): the same sums."""
    generator = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, 3, 300, 32, generator=generator).unbind(0)
    queries = torch.randn(9, 300, 32, generator=generator)
    total = torch.zeros(9, 300, dtype=torch.float64)
    for start, end in [(0, 128), (128, 256), (256, 300)]:
        _, sums = IMPLEMENTATIONS["csrc"].prompt_attention(
            keys[:, :end], values[:, :end], queries[:, start:end], 1 / math.sqrt(32)
        )
        total[:, :end] += sums
    torch.testing.assert_close(total, attention_column_sums(keys, queries), **TOLERANCE)
