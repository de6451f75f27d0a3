"""window_scores against its float64 loop reference and kvpolicy's SnapKV window_scores, on strided keys."""

import pytest
import torch

from kvpolicy.policies.snapkv import window_scores as snapkv_window_scores
from kvpolicy_triton import window_scores, window_scores_reference
from tests.kernels.paging import DEVICE, DTYPES

QUERY_HEADS, HEAD_SIZE = 6, 32
# Float32 kernel against float64 on the same (upcast) inputs, whatever their dtype.
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads", [3, 2], ids=["G2", "G3"])
@pytest.mark.parametrize("length, window, pool", [(75, 20, 7), (40, 8, 3), (21, 5, 4)])
def test_window_scores_triton(dtype, kv_heads, length, window, pool):
    generator = torch.Generator().manual_seed(6)
    # Keys as a [L, Hkv, D] buffer seen head-major: not contiguous.
    keys = (2 * torch.randn(length, kv_heads, HEAD_SIZE, generator=generator)).to(DEVICE, dtype).transpose(0, 1)
    queries = (2 * torch.randn(QUERY_HEADS, window, HEAD_SIZE, generator=generator)).to(DEVICE, dtype)

    got = window_scores(keys, queries, pool)
    want = window_scores_reference(keys, queries, pool)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, **TOLERANCE)
    if pool % 2:  # the policies take odd kernels only (an even one pads one more score at the end)
        snapkv = snapkv_window_scores(keys.cpu(), queries.cpu(), pool)
        torch.testing.assert_close(got.cpu().double(), snapkv, **TOLERANCE)
