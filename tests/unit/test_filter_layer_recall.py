"""The filter-layer recall diagnostic ranks a key's page as a loop over OmniKV's eq. (3)-(4) does."""

import pytest
import torch

from benchmarks.filter_layer_recall import page_ranks


def reference_rank(layer: torch.Tensor, positions: list[int], page_size: int, weights: list[float]) -> int:
    """Weighted window rows, max over heads, summed per page; the best rank among the pages before the last."""
    window, n = len(weights), layer.shape[-1]
    scores = [
        sum(
            w * max(layer[0, h, n - window + j, t].item() for h in range(layer.shape[1])) for j, w in enumerate(weights)
        )
        for t in range(n)
    ]
    pages = [sum(scores[p : p + page_size]) for p in range(0, n, page_size)][:-1]
    order = sorted(range(len(pages)), key=lambda p: -pages[p])
    return min(order.index(p // page_size) for p in positions)


@pytest.mark.parametrize(("selector", "weights"), [("last", [1.0]), ("exponential", [0.125, 0.25, 0.5])])
def test_page_ranks_match_a_loop(selector, weights):
    torch.manual_seed(0)
    n, page_size = 22, 4
    layers = [torch.rand(1, 3, n, n, dtype=torch.float64).tril().softmax(-1) for _ in range(2)]
    positions = [9, 10]
    ranks = page_ranks(layers, positions, page_size, selector, len(weights))
    assert ranks == [reference_rank(layer, positions, page_size, weights) for layer in layers]
