"""OmniKV against plain-torch references written from the paper's equations (1)-(4) and its §5 Mem%."""

import math

import numpy as np
import pytest
import torch

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError
from kvpolicy.policies import ModelShape
from kvpolicy.policies.omnikv import OmniKV, PageChoice, context_scores, page_sums


def reference_scores(queries, keys, length, alpha):
    """Eq. (3)-(4) for one sequence, loop by loop: S[t] = sum_j alpha_j max_h softmax(q_hj K_h^T / sqrt(d))[t]."""
    q_heads, window, dim = queries.shape
    group = q_heads // keys.shape[0]
    scores = torch.zeros(length, dtype=torch.float64)
    for j in range(window):
        position = length - window + j
        best = torch.zeros(position + 1, dtype=torch.float64)
        for h in range(q_heads):
            k = keys[h // group, : position + 1].double()
            attention = torch.softmax(k @ queries[h, j].double() / math.sqrt(dim), dim=0)
            best = torch.maximum(best, attention)
        scores[: position + 1] += alpha[j] * best
    return scores


ALPHAS = {
    "last": lambda w: [0.0] * (w - 1) + [1.0],
    "uniform": lambda w: [1.0] * w,
    "exponential": lambda w: [2.0 ** (j - w) for j in range(w)],
}


@pytest.mark.parametrize("selector", list(ALPHAS))
@pytest.mark.parametrize("window", [1, 4])
def test_context_scores_equal_the_equations(selector, window):
    torch.manual_seed(0)
    lengths = torch.tensor([37, 64, 50])
    queries = torch.randn(3, 6, window, 16)
    keys = torch.randn(3, 2, 64, 16)
    scores = context_scores(queries, keys, lengths, selector)
    for row, length in enumerate(lengths.tolist()):
        expected = reference_scores(queries[row], keys[row], length, ALPHAS[selector](window))
        torch.testing.assert_close(scores[row, :length], expected, rtol=1e-5, atol=1e-6)
        assert (scores[row, length:] == 0).all()


def reference_pages(scores, length, page_size, budget):
    """Pages by their summed token scores, the current (last) page always in; all pages if they fit."""
    num_pages = math.ceil(length / page_size)
    keep = math.ceil(budget / page_size)
    if num_pages <= keep:
        return list(range(num_pages))
    sums = [float(scores[p * page_size : min((p + 1) * page_size, length)].sum()) for p in range(num_pages - 1)]
    best = sorted(range(num_pages - 1), key=lambda p: -sums[p])[: keep - 1]
    return sorted(best) + [num_pages - 1]


def test_page_selection_equals_reference():
    torch.manual_seed(1)
    lengths = torch.tensor([300, 129, 64, 1000])
    scores = torch.rand(4, 1000, dtype=torch.float64)
    for row, length in enumerate(lengths.tolist()):
        scores[row, length:] = 0
    budgets = [100, 256, 512, 200]
    choice = PageChoice.of(lengths.numpy(), 32, budgets)
    chosen, counts = choice.choose(page_sums(scores, 32)), choice.counts
    for row, length in enumerate(lengths.tolist()):
        assert chosen[row, : counts[row]].tolist() == reference_pages(scores[row], length, 32, budgets[row])
    assert counts.tolist() == [4, 5, 2, 7] and chosen.shape == (4, 7)
    assert not chosen[counts[:, None] <= np.arange(7)].any(), "zeros past each row's count"


def test_a_high_scoring_token_brings_its_page():
    scores = torch.zeros(1, 256, dtype=torch.float64)
    scores[0, 70] = 1.0
    assert PageChoice.of(np.array([256]), 32, [64]).choose(page_sums(scores, 32)).tolist() == [[2, 7]]


def test_layer_roles_follow_equations_1_and_2():
    """Full attention below L0, in filter layers and the layer after each; the rest use the last filter's pick."""
    sources = OmniKV(filter_layers=(2, 8, 18), dense_layers=2).source_layers(24)
    dense = [layer for layer, source in enumerate(sources) if source is None]
    assert dense == [0, 1, 2, 3, 8, 9, 18, 19]
    assert sources[4:8] == [2] * 4 and sources[10:18] == [8] * 8 and sources[20:] == [18] * 4


def test_layers_before_the_first_filter_stay_dense():
    sources = OmniKV(filter_layers=(5,), dense_layers=1).source_layers(8)
    assert sources == [None] * 7 + [5]


def test_bad_filter_layers_are_refused_with_the_range():
    with pytest.raises(ValueError, match=r"in \[--kv-dense-layers 2, 11\]"):
        OmniKV(filter_layers=(2, 12), dense_layers=2).source_layers(12)
    with pytest.raises(KVPolicyConfigError, match="increasing order"):
        KVPolicyConfig(policy="omnikv", budget=256, filter_layers=(8, 2))


def test_mem_percent_budget_matches_the_papers_example():
    """§5: Mem% 30% with the full layers holding 25% leaves 6.7% of the context to sparse layers."""
    policy = OmniKV(filter_layers=(2, 8, 18), dense_layers=2)  # (2*3 + 2) / 32 = 25%
    assert policy.sparse_budget(0.30, 100_000, 32) == math.ceil((0.30 - 0.25) / 0.75 * 100_000)
    config = KVPolicyConfig(policy="omnikv", ratio=0.30)
    assert config.sparse_budget(100_000, 32) == 6667
    with pytest.raises(KVPolicyConfigError, match="below what the full-attention layers"):
        KVPolicyConfig(policy="omnikv", ratio=0.2).sparse_budget(1000, 32)


def test_paged_keys_score_like_the_flat_sequence():
    """Keys given as [pages, page_size] blocks (a strided view, as read from a paged cache) score the same."""
    torch.manual_seed(2)
    queries, lengths = torch.randn(2, 6, 1, 16), torch.tensor([40, 64])
    blocks = torch.randn(2, 2, 4, 16, 16).transpose(-1, -2).contiguous().transpose(-1, -2)  # K stored transposed
    flat = blocks.reshape(2, 2, 64, 16)
    torch.testing.assert_close(context_scores(queries, blocks, lengths), context_scores(queries, flat, lengths))


def test_omnikv_refuses_a_model_its_filter_layers_or_ratio_do_not_fit():
    policy = OmniKV(filter_layers=(2, 9, 15))
    policy.check_model(ModelShape("m", num_layers=30, num_kv_heads=3, max_model_len=8192, ratio=0.5))
    with pytest.raises(ValueError, match=r"out of range.*python -m kvpolicy.offline.calibrate --model m"):
        policy.check_model(ModelShape("m", num_layers=12, num_kv_heads=3))
    with pytest.raises(ValueError, match="raise --kv-ratio"):
        policy.check_model(ModelShape("m", num_layers=30, num_kv_heads=3, max_model_len=8192, ratio=0.1))
