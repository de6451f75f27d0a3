"""keydiff_scores against its float64 reference and kvpolicy's KeyDiff keydiff_scores."""

import pytest
import torch

from kvpolicy.policies.keydiff import keydiff_scores as policy_keydiff_scores
from kvpolicy_triton import keydiff_scores, keydiff_scores_reference
from tests.kernels.paging import DEVICE, DTYPES

# Scores are cosines in [-1, 1]: float32 against float64 on the same (upcast) inputs.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count, head_size", [(1, 16), (37, 32), (150, 80)])
def test_keydiff_scores_triton(dtype, count, head_size):
    generator = torch.Generator().manual_seed(7)
    # A shared direction makes the anchor meaningful; keys viewed head-major from [n, H, D] (not contiguous).
    keys = torch.randn(count, 3, head_size, generator=generator) + torch.randn(1, 3, head_size, generator=generator)
    keys = keys.to(DEVICE, dtype).transpose(0, 1)
    got = keydiff_scores(keys)
    assert got.dtype == torch.float32 and got.shape == (3, count)
    torch.testing.assert_close(got.double(), keydiff_scores_reference(keys), **TOLERANCE)
    torch.testing.assert_close(got.cpu().double(), policy_keydiff_scores(keys.cpu()), **TOLERANCE)
