"""R-KV's scorer against a plain reference on random tensors, and what its redundancy term is for."""

import pytest
import torch

from kvpolicy.policies import PromptKV, make_policy
from kvpolicy.policies.rkv import redundancy_scores
from tests.rkv_reference import reference_redundancy, reference_rkv_scores
from tests.snapkv_reference import reference_keep

H, G, D = 3, 3, 16
WINDOW, KERNEL, BUDGET = 8, 7, 40


@pytest.fixture(params=[0, 1])
def prompt(request):
    gen = torch.Generator().manual_seed(request.param)
    keys = torch.randn(H, 120, D, generator=gen)
    keys[:, 60:70] = keys[:, 20:30] + 0.1 * torch.randn(H, 10, D, generator=gen)  # look-alikes, later copies
    return PromptKV(keys, torch.randn(H * G, WINDOW, D, generator=gen) * 2, layer=0, num_layers=2)


@pytest.mark.parametrize("lam, threshold", [(0.1, 0.5), (0.5, 0.3), (1.0, 0.5)])
def test_rkv_keeps_each_heads_best_scores_and_the_window(prompt, lam, threshold):
    scores = reference_rkv_scores(prompt.keys, prompt.window_queries, KERNEL, lam, threshold)
    expected = reference_keep([BUDGET - WINDOW] * H, scores, prompt.num_tokens, WINDOW)
    policy = make_policy(
        "rkv", window=WINDOW, pool_kernel=KERNEL, importance_weight=lam, duplicate_similarity=threshold
    )
    assert [k.tolist() for k in policy.keep(prompt, BUDGET)] == expected


def test_redundancy_equals_the_reference_across_row_chunks(monkeypatch, prompt):
    monkeypatch.setattr("kvpolicy.policies.rkv.SIMILARITY_ROWS", 7)
    got = redundancy_scores(prompt.keys, 0.5)
    assert torch.allclose(got, torch.tensor(reference_redundancy(prompt.keys, 0.5), dtype=torch.float64), atol=1e-12)


def test_of_three_copies_of_a_key_the_latest_is_kept():
    """Redundancy alone (lambda 0), keys otherwise orthogonal: each copy's most recent look-alike does not count,
    so the first copy is the most redundant, the last is as unique as any key, and the two older ones go first."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.linalg.qr(torch.randn(64, 64, generator=gen))[0][None].clone()
    keys[0, 30] = keys[0, 50] = keys[0, 10]
    redundancy = redundancy_scores(keys, 0.5)[0]
    assert redundancy[10] > redundancy[30] > redundancy[50] and torch.isclose(redundancy[50], redundancy[0])
    prompt = PromptKV(keys, torch.randn(1, 4, 64, generator=gen))
    kept = make_policy("rkv", window=4, importance_weight=0.0).keep(prompt, 62)[0].tolist()
    assert sorted(set(range(64)) - set(kept)) == [10, 30]
