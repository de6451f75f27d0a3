"""SnapKV, Ada-SnapKV, PyramidKV, Ada-Pyramid, Ada-Mix, Ada-Heavy and StreamingLLM against plain references on random
tensors."""

import threading

import pytest
import torch

from kvpolicy.policies import HeadGroup, PromptKV, make_policy
from kvpolicy.policies.h2o import attention_column_sums
from kvpolicy.policies.snapkv import pyramid_capacity
from tests.h2o_reference import reference_h2o_scores
from tests.snapkv_reference import (
    reference_ada_counts,
    reference_keep,
    reference_layer_ranks,
    reference_mix_scores,
    reference_pool,
    reference_pyramid,
    reference_scores,
)

H, G, D = 3, 3, 16


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


@pytest.mark.parametrize("shift, group", [(0, "mean"), (2, "mean"), (2, "max"), (0, "max")])
def test_adasnap_with_a_moved_pooling_window_and_the_groups_max(prompt, shift, group):
    scores = reference_scores(prompt.keys, prompt.window_queries, WINDOW, KERNEL, shift, group)
    counts = reference_ada_counts(scores, BUDGET - WINDOW, 0.5)
    policy = make_policy("adasnap", window=WINDOW, pool_kernel=KERNEL, pool_shift=shift, group_scores=group)
    assert as_lists(policy.keep(prompt, BUDGET)) == reference_keep(counts, scores, prompt.num_tokens, WINDOW)


@pytest.mark.parametrize(
    "mix, alpha, combine", [(0.5, 0.5, "blend"), (1.0, 0.5, "blend"), (1.0, 1.0, "blend"), (0.5, 0.5, "union")]
)
def test_adamix_allocates_over_combined_window_and_keydiff_ranks(prompt, mix, alpha, combine):
    """With adamix's own pooling (window moved 4 back: 2 at this kernel of 5) and the group's max."""
    shift = 2
    scores = reference_mix_scores(prompt.keys, prompt.window_queries, WINDOW, KERNEL, mix, combine, shift, "max")
    counts = reference_ada_counts(scores, BUDGET - WINDOW, alpha)
    policy = make_policy(
        "adamix", window=WINDOW, pool_kernel=KERNEL, pool_shift=shift, mix=mix, alpha=alpha, combine=combine
    )
    assert policy.group_scores == "max"
    assert as_lists(policy.keep(prompt, BUDGET)) == reference_keep(counts, scores, prompt.num_tokens, WINDOW)


def test_adamix_without_keydiff_is_adasnap_with_its_pooling(prompt):
    adamix = make_policy("adamix", window=WINDOW, pool_kernel=KERNEL, mix=0.0, combine="blend").keep(prompt, BUDGET)
    adasnap = make_policy("adasnap", window=WINDOW, pool_kernel=KERNEL, pool_shift=4, group_scores="max")
    assert as_lists(adamix) == as_lists(adasnap.keep(prompt, BUDGET))


@pytest.mark.parametrize("seed, pool_heavy", [(0, True), (1, True), (0, False)])
def test_adaheavy_allocates_over_the_union_of_window_and_h2o_ranks(seed, pool_heavy):
    """The window's queries with every prompt query (as the GPU ops hand them), or with the column sums
    (as the CPU ops sum prompt chunks): the same tokens kept, the reference's; H2O's scores pooled as the
    window's, or not."""
    gen = torch.Generator().manual_seed(seed)
    length, shift = 150, 2
    keys = torch.randn(H, length, D, generator=gen)
    queries = torch.randn(H * G, length, D, generator=gen) * 2
    window = reference_layer_ranks(reference_scores(keys, queries[:, -WINDOW:], WINDOW, KERNEL, shift, "max"))
    heavy = [row[: window.shape[1]] for row in reference_h2o_scores(keys.tolist(), queries.tolist())]
    if pool_heavy:
        heavy = [reference_pool(row, KERNEL, shift) for row in heavy]
    scores = torch.maximum(window, reference_layer_ranks(torch.tensor(heavy, dtype=torch.float64)))
    expected = reference_keep(reference_ada_counts(scores, BUDGET - WINDOW, 0.5), scores, length, WINDOW)
    policy = make_policy("adaheavy", window=WINDOW, pool_kernel=KERNEL, pool_shift=shift, pool_heavy=pool_heavy)
    every_query = PromptKV(keys, queries[:, -WINDOW:], layer=0, num_layers=4, queries=queries)
    assert as_lists(policy.keep(every_query, BUDGET)) == expected
    sums = attention_column_sums(keys, queries)
    summed = PromptKV(keys, queries[:, -WINDOW:], layer=0, num_layers=4, queries=queries[:, -WINDOW:], column_sums=sums)
    assert as_lists(policy.keep(summed, BUDGET)) == expected


@pytest.mark.parametrize("capacity, prefix", [(200, 3000), (96, 1068), (96, 97)])
def test_pyramid_mean_over_layers_is_the_budget(capacity, prefix):
    capacities = [pyramid_capacity(capacity, prefix, layer, 30) for layer in range(30)]
    assert capacities[0] > capacities[-1]
    assert max(capacities) <= prefix
    assert abs(sum(capacities) / 30 - capacity) <= 0.5


def test_streaming_keeps_sinks_and_recent_tokens():
    prompt = PromptKV(torch.zeros(H, 100, D))
    keep = make_policy("streaming", sink_tokens=4).keep(prompt, 20)
    assert as_lists(keep) == [list(range(4)) + list(range(84, 100))] * H


@pytest.mark.parametrize("name", ["snapkv", "adasnap", "pyramid", "adapyramid", "adamix", "streaming"])
def test_short_prompts_are_kept_whole(name):
    prompt = PromptKV(torch.randn(H, 30, D), torch.randn(H * G, 8, D))
    keep = make_policy(name, window=WINDOW, pool_kernel=KERNEL).keep(prompt, 40)
    assert as_lists(keep) == [list(range(30))] * H


@pytest.mark.parametrize("name", ["snapkv", "adasnap", "pyramid", "adapyramid", "adamix", "streaming"])
def test_no_layer_keeps_more_than_the_policys_layer_bound(name):
    """The bound prefix caching sizes a prompt's own blocks by (``Policy.layer_token_bound``)."""
    policy = make_policy(name, window=WINDOW, pool_kernel=KERNEL)
    gen = torch.Generator().manual_seed(7)
    for layer in range(4):
        keys = torch.randn(H, 150, D, generator=gen)
        queries = torch.randn(H * G, WINDOW, D, generator=gen) * 4
        kept = policy.keep(PromptKV(keys, queries, layer=layer, num_layers=4), BUDGET)
        assert sum(k.numel() for k in kept) <= policy.layer_token_bound(BUDGET, 150, H)


def test_a_window_shorter_than_asked_is_kept_whole():
    """A prefix-cache hit that reached into the window leaves fewer window queries: the window is those."""
    gen = torch.Generator().manual_seed(3)
    keys, queries = torch.randn(H, 150, D, generator=gen), torch.randn(H * G, 3, D, generator=gen)
    kept = make_policy("snapkv", window=WINDOW, pool_kernel=KERNEL).keep(PromptKV(keys, queries), BUDGET)
    scores = reference_scores(keys, queries, 3, KERNEL)
    assert as_lists(kept) == reference_keep([BUDGET - WINDOW] * H, scores, 150, 3)


class ThreadGroup:
    """Tensor-parallel ranks as threads: ``gather`` stacks every rank's tensor, as the engine's collective does."""

    def __init__(self, size: int):
        self.size, self.parts = size, [None] * size
        self.barrier = threading.Barrier(size)

    def head_group(self, rank: int) -> HeadGroup:
        def gather(tensor):
            self.parts[rank] = tensor
            self.barrier.wait()
            stacked = torch.cat(self.parts)
            self.barrier.wait()
            return stacked

        return HeadGroup(rank, self.size, gather)


@pytest.mark.parametrize("name", ["adasnap", "adapyramid", "adamix", "snapkv"])
def test_heads_split_over_ranks_keep_what_one_rank_keeps_with_every_head(prompt, name):
    """``--kv-tp-allocation exact``: Ada-KV's layer-wide choice over heads gathered from every rank."""
    policy = make_policy(name, window=WINDOW, pool_kernel=KERNEL)
    whole = as_lists(policy.keep(prompt, BUDGET))
    ranks, group = 3, ThreadGroup(3)  # one KV head per rank
    kept = [None] * ranks

    def keep(rank: int) -> None:
        local = PromptKV(
            prompt.keys[rank : rank + 1],
            prompt.window_queries[rank * G : (rank + 1) * G],
            layer=prompt.layer,
            num_layers=prompt.num_layers,
            heads=group.head_group(rank),
        )
        kept[rank] = as_lists(policy.keep(local, BUDGET))

    threads = [threading.Thread(target=keep, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [head for rank in kept for head in rank] == whole
