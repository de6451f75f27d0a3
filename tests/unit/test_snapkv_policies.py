"""SnapKV, Ada-SnapKV, PyramidKV, Ada-Pyramid and StreamingLLM against plain references.

The references follow the papers' descriptions with loops and no shared code:
per query head and window query, a causal softmax; summed over the window;
max-pooled with kernel k; averaged over a GQA group; then top-k.
"""

import math

import pytest
import torch

from kvpolicy.policies import PromptKV, make_policy

H, G, D = 3, 3, 16


def reference_scores(keys, queries, window, kernel):
    length = keys.shape[1]
    prefix = length - window
    scores = torch.zeros(H, prefix, dtype=torch.float64)
    for h in range(H):
        for g in range(G):
            q_head = h * G + g
            summed = [0.0] * prefix
            for i in range(window):
                position = prefix + i
                logits = [
                    float(torch.dot(queries[q_head, i].double(), keys[h, j].double())) / math.sqrt(D)
                    for j in range(position + 1)
                ]
                top = max(logits)
                exps = [math.exp(x - top) for x in logits]
                total = sum(exps)
                for j in range(prefix):
                    summed[j] += exps[j] / total
            pooled = [max(summed[max(0, j - kernel // 2): j + kernel // 2 + 1]) for j in range(prefix)]
            for j in range(prefix):
                scores[h, j] += pooled[j] / G
    return scores


def best(scores_row, n):
    order = sorted(range(len(scores_row)), key=lambda j: (-scores_row[j], j))
    return sorted(order[:n])


def reference_keep(counts, scores, length, window):
    recent = list(range(length - window, length))
    return [best(scores[h].tolist(), counts[h]) + recent for h in range(H)]


def reference_ada_counts(scores, capacity, alpha):
    flat = [(-float(scores[h, j]), h, j) for h in range(H) for j in range(scores.shape[1])]
    winners = sorted(flat)[: H * capacity]
    counts = [sum(1 for _, h, _ in winners if h == head) for head in range(H)]
    return [round(c * (1 - alpha) + int(capacity * alpha)) for c in counts]


def reference_pyramid(capacity, prefix, layer, layers, beta=20):
    low, high = capacity // beta, 2 * capacity - capacity // beta
    if high >= prefix:
        high, low = prefix, 2 * capacity - prefix
    return high - layer * ((high - low) // (layers - 1))


@pytest.fixture(params=[0, 1, 2])
def prompt(request):
    gen = torch.Generator().manual_seed(request.param)
    length = 150
    keys = torch.randn(H, length, D, generator=gen)
    queries = torch.randn(H * G, 8, D, generator=gen) * 2
    return PromptKV(keys, queries, layer=request.param, num_layers=4)


WINDOW, KERNEL, BUDGET = 8, 5, 40


def as_lists(keep):
    return [k.tolist() for k in keep]


def test_snapkv_keeps_each_heads_top_scores_and_the_window(prompt):
    scores = reference_scores(prompt.keys, prompt.window_queries, WINDOW, KERNEL)
    expected = reference_keep([BUDGET - WINDOW] * H, scores, prompt.num_tokens, WINDOW)
    got = make_policy("snapkv", window=WINDOW, pool_kernel=KERNEL).keep(prompt, BUDGET)
    assert as_lists(got) == expected


def test_adasnap_spreads_the_layer_budget_over_heads(prompt):
    scores = reference_scores(prompt.keys, prompt.window_queries, WINDOW, KERNEL)
    counts = reference_ada_counts(scores, BUDGET - WINDOW, 0.5)
    got = make_policy("adasnap", window=WINDOW, pool_kernel=KERNEL).keep(prompt, BUDGET)
    assert as_lists(got) == reference_keep(counts, scores, prompt.num_tokens, WINDOW)
    assert all(n >= int((BUDGET - WINDOW) * 0.5) for n in counts), "alpha safeguard"


def test_pyramid_budgets_fall_with_depth(prompt):
    scores = reference_scores(prompt.keys, prompt.window_queries, WINDOW, KERNEL)
    capacity = reference_pyramid(BUDGET - WINDOW, prompt.num_tokens - WINDOW, prompt.layer, 4)
    got = make_policy("pyramid", window=WINDOW, pool_kernel=KERNEL).keep(prompt, BUDGET)
    assert as_lists(got) == reference_keep([capacity] * H, scores, prompt.num_tokens, WINDOW)
    got_ada = make_policy("adapyramid", window=WINDOW, pool_kernel=KERNEL).keep(prompt, BUDGET)
    counts = reference_ada_counts(scores, capacity, 0.5)
    assert as_lists(got_ada) == reference_keep(counts, scores, prompt.num_tokens, WINDOW)


def test_pyramid_mean_over_layers_is_the_budget():
    capacities = [reference_pyramid(200, 3000, layer, 30) for layer in range(30)]
    assert capacities[0] > capacities[-1]
    assert abs(sum(capacities) / 30 - 200) < 200 * 0.05


def test_streaming_keeps_sinks_and_recent_tokens():
    prompt = PromptKV(torch.zeros(H, 100, D))
    keep = make_policy("streaming", sink_tokens=4).keep(prompt, 20)
    assert as_lists(keep) == [list(range(4)) + list(range(84, 100))] * H


@pytest.mark.parametrize("name", ["snapkv", "adasnap", "pyramid", "adapyramid", "streaming"])
def test_short_prompts_are_kept_whole(name):
    prompt = PromptKV(torch.randn(H, 30, D), torch.randn(H * G, 8, D))
    keep = make_policy(name, window=WINDOW, pool_kernel=KERNEL).keep(prompt, 40)
    assert as_lists(keep) == [list(range(30))] * H
