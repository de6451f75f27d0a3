"""KeyDiff, H2O and D2O against plain loop references written from the papers, on random tensors.

No code shared with ``kvpolicy.policies``: cosine similarities, softmaxes,
column sums, rankings and merges are Python loops over lists of floats.
"""

import math

import pytest
import torch

from kvpolicy.policies import POLICIES, Mode, PromptKV, make_policy
from kvpolicy.policies.d2o import D2O, layer_budgets, merge_evicted, prompt_attention_variance
from kvpolicy.policies.h2o import H2O, add_new_token, new_token_attention
from kvpolicy.policies.keydiff import keydiff_block_step
from tests.h2o_reference import dot, reference_column_sums, reference_h2o_scores

H, G, D, L = 3, 3, 8, 70


def cosine(a, b):
    return dot(a, b) / (math.sqrt(dot(a, a)) * math.sqrt(dot(b, b)))


def top(scores, n):
    """Indices of the n highest scores, ties to the earlier index, ascending."""
    return sorted(sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:n])


def reference_keydiff(keys, budget):
    """Eq. 8 on one head's cache (a list of key vectors): keep the keys least similar to the mean unit key."""
    units = [[x / math.sqrt(dot(k, k)) for x in k] for k in keys]
    anchor = [sum(u[d] for u in units) / len(units) for d in range(len(keys[0]))]
    return top([-cosine(k, anchor) for k in keys], budget)


def reference_heavy_hitters(scores, budget, recent, sinks):
    length = len(scores)
    middle = list(range(sinks, length - recent))
    best = [middle[i] for i in top([scores[j] for j in middle], budget - recent - sinks)]
    return sorted(list(range(sinks)) + best + list(range(length - recent, length)))


@pytest.fixture(params=[0, 1, 2])
def prompt(request):
    gen = torch.Generator().manual_seed(request.param)
    keys = torch.randn(H, L, D, generator=gen, dtype=torch.float64)
    values = torch.randn(H, L, D, generator=gen, dtype=torch.float64)
    queries = torch.randn(H * G, L, D, generator=gen, dtype=torch.float64) * 2
    return PromptKV(keys, queries=queries, values=values)


def as_lists(keep):
    return [k.tolist() for k in keep]


def test_registry_has_keydiff_h2o_and_d2o():
    assert POLICIES["keydiff"].mode is Mode.RELOCATE and not POLICIES["keydiff"].inputs.window
    assert POLICIES["h2o"] is H2O and POLICIES["d2o"] is D2O
    assert D2O.schedule.across_layers and not H2O.schedule.across_layers
    assert H2O.inputs.attention and D2O.inputs.attention and not POLICIES["keydiff"].inputs.attention
    assert all(POLICIES[name].schedule.in_decode for name in ("keydiff", "h2o", "d2o"))


def test_keydiff_keeps_the_keys_least_like_the_anchor(prompt):
    keys = prompt.keys.tolist()
    got = make_policy("keydiff").keep(prompt, 20)
    assert as_lists(got) == [reference_keydiff(keys[h], 20) for h in range(H)]


@pytest.mark.parametrize("block", [7, 16, 70])
def test_keydiff_block_processing_matches_a_loop_over_blocks(prompt, block):
    budget = 20
    expected = []
    for h in range(H):
        cache = []  # (position, key) in position order
        for start in range(0, L, block):
            cache += [(p, prompt.keys[h, p].tolist()) for p in range(start, min(start + block, L))]
            if len(cache) > budget:
                cache = [cache[i] for i in reference_keydiff([k for _, k in cache], budget)]
        expected.append([p for p, _ in cache])

    positions = torch.zeros(H, 0, dtype=torch.int64)
    cached = prompt.keys[:, :0]
    for start in range(0, L, block):
        new = torch.arange(start, min(start + block, L)).expand(H, -1)
        survivors = keydiff_block_step(cached, prompt.keys[:, start : start + block], budget)
        positions = torch.cat([positions, new], dim=1).gather(1, survivors)
        cached = prompt.keys.gather(1, positions[..., None].expand(-1, -1, D))
    assert positions.tolist() == expected
    if block >= L:
        assert positions.tolist() == as_lists(make_policy("keydiff").keep(prompt, budget))


def test_h2o_keeps_recent_tokens_and_heavy_hitters(prompt):
    scores = reference_h2o_scores(prompt.keys.tolist(), prompt.queries.tolist())
    got = H2O(recent_fraction=1 / 3).keep(prompt, 24)
    assert as_lists(got) == [reference_heavy_hitters(scores[h], 24, 8, 0) for h in range(H)]


def reference_generation_attention(keys, queries, head, t, cache):
    """Token t's attention over the cached positions, for one KV head: softmax per query head, group mean."""
    added = [0.0] * len(cache)
    for g in range(G):
        logits = [dot(queries[head * G + g][t], keys[head][p]) / math.sqrt(len(keys[0][0])) for p in cache]
        peak = max(logits)
        exps = [math.exp(x - peak) for x in logits]
        for i, e in enumerate(exps):
            added[i] += e / sum(exps) / G
    return added


def reference_h2o_generation(keys, queries, prompt_len, budget, recent, block):
    """H2O over a prompt, then over each generated token t (key and query t), evicting a page's worth at a time.

    Each new token's attention is added to the cached tokens' scores; once
    the cache holds ``budget + block`` tokens it is cut back to ``budget``
    by the prompt's rule. Returns each head's kept positions at the end.
    """
    scores = reference_h2o_scores([k[:prompt_len] for k in keys], [q[:prompt_len] for q in queries])
    result = []
    for h in range(len(keys)):
        kept = reference_heavy_hitters(scores[h], budget, recent, 0)
        score = {p: scores[h][p] for p in kept}
        for t in range(prompt_len, len(keys[0])):
            kept = kept + [t]
            score[t] = 0.0
            for p, weight in zip(kept, reference_generation_attention(keys, queries, h, t, kept)):
                score[p] += weight
            if len(kept) >= budget + block:
                kept = [kept[i] for i in reference_heavy_hitters([score[p] for p in kept], budget, recent, 0)]
        result.append(kept)
    return result


def test_new_token_attention_is_the_group_mean_softmax_over_each_padded_sequence():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(H, 13, D, generator=gen, dtype=torch.float64)
    queries = torch.randn(H * G, 13, D, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([13, 9, 5])
    new = queries.view(H, G, 13, D)[torch.arange(H), :, lengths - 1]  # head h's token at position lengths[h] - 1
    got = new_token_attention(keys, lengths, new)
    scores = torch.rand(H, 12, generator=gen, dtype=torch.float64)
    for h, n in enumerate(lengths.tolist()):
        weights = reference_generation_attention(keys.tolist(), queries.tolist(), h, n - 1, list(range(n)))
        assert got[h, :n].tolist() == pytest.approx(weights, abs=1e-6)
        assert got[h, n:].tolist() == [0.0] * (13 - n)
    added = add_new_token(scores, got)
    assert torch.equal(added, torch.cat([scores, torch.zeros(H, 1, dtype=torch.float64)], dim=1) + got)


def test_h2o_generation_in_the_engine_order_equals_the_reference(prompt):
    """The engine's decode: each new token's weights added, compress with the carried scores once a page's worth is over."""
    prompt_len, budget, block = 40, 16, 8
    policy = H2O(recent_fraction=0.25)
    first = policy.compress(PromptKV(prompt.keys[:, :prompt_len], queries=prompt.queries[:, :prompt_len]), budget)
    kept, scores, passes = torch.stack(first.kept), first.scores, 0
    for t in range(prompt_len, L):
        kept = torch.cat([kept, torch.full((H, 1), t)], dim=1)
        cache_keys = prompt.keys.gather(1, kept[..., None].expand(-1, -1, D))
        new_queries = prompt.queries[:, t].view(H, G, D)
        weights = new_token_attention(cache_keys, torch.full((H,), kept.shape[1]), new_queries)
        scores = add_new_token(scores, weights)
        if kept.shape[1] >= budget + block:
            result = policy.compress(PromptKV(cache_keys, scores=scores), budget)
            kept, scores, passes = kept.gather(1, torch.stack(result.kept)), result.scores, passes + 1
    assert passes == 3
    expected = reference_h2o_generation(prompt.keys.tolist(), prompt.queries.tolist(), prompt_len, budget, 4, block)
    assert kept.tolist() == expected


def test_d2o_layer_variance_is_the_mean_over_query_heads(prompt):
    keys, queries = prompt.keys.tolist(), prompt.queries.tolist()
    variances = []
    for q in range(H * G):
        sums = reference_column_sums(keys, queries, q)
        mean = sum(sums) / L
        variances.append(sum((s - mean) ** 2 for s in sums) / L)
    assert prompt_attention_variance(prompt.keys, prompt.queries) == pytest.approx(sum(variances) / len(variances))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_d2o_layer_budgets_inverse_variance_softmax(seed):
    gen = torch.Generator().manual_seed(seed)
    variances = (torch.rand(30, generator=gen, dtype=torch.float64) * 3 + 0.3).tolist()
    budget = 101
    weights = [math.exp(1 / v) for v in variances]
    exact = [30 * budget * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    for layer in sorted(range(30), key=lambda i: (-(exact[i] - counts[i]), i))[: 30 * budget - sum(counts)]:
        counts[layer] += 1
    got = layer_budgets(variances, budget)
    assert got == counts
    assert sum(got) == 30 * budget
    order = sorted(range(30), key=lambda i: variances[i])
    assert [got[i] for i in order] == sorted(got, reverse=True), "denser layers (lower variance) keep more"


def reference_merge(kept_keys, kept_values, evicted_keys, evicted_values, threshold, beta):
    """Eq. 9-12 for one head: nearest kept key, EMA threshold, weighted merge of K and V."""
    nearest, best = [], []
    for e in evicted_keys:
        sims = [cosine(e, k) for k in kept_keys]
        nearest.append(max(range(len(sims)), key=lambda j: (sims[j], -j)))
        best.append(sims[nearest[-1]])
    step = sum(best) / len(best)
    threshold = step if threshold is None else beta * step + (1 - beta) * threshold
    keys, values, merged = [], [], 0
    for j, (k, v) in enumerate(zip(kept_keys, kept_values)):
        weights = [math.exp(best[i]) for i in range(len(best)) if nearest[i] == j and best[i] >= threshold]
        sources = [i for i in range(len(best)) if nearest[i] == j and best[i] >= threshold]
        merged += len(sources)
        norm = math.e + sum(weights)
        keys.append(
            [
                (math.e * k[d] + sum(w * evicted_keys[i][d] for w, i in zip(weights, sources))) / norm
                for d in range(len(k))
            ]
        )
        values.append(
            [
                (math.e * v[d] + sum(w * evicted_values[i][d] for w, i in zip(weights, sources))) / norm
                for d in range(len(v))
            ]
        )
    return keys, values, threshold, merged


def test_d2o_evicts_by_accumulated_attention_and_merges_into_nearest_keys(prompt):
    budget = 24
    recent, sinks = 6, 4  # N:M = 3:1
    scores = reference_h2o_scores(prompt.keys.tolist(), prompt.queries.tolist())
    got = D2O().compress(prompt, budget)
    for h in range(H):
        kept = reference_heavy_hitters(scores[h], budget, recent, sinks)
        evicted = [p for p in range(L) if p not in kept]
        keys, values = prompt.keys[h].tolist(), prompt.values[h].tolist()
        ref_keys, ref_values, threshold, merged = reference_merge(
            [keys[p] for p in kept],
            [values[p] for p in kept],
            [keys[p] for p in evicted],
            [values[p] for p in evicted],
            None,
            0.7,
        )
        assert 0 < merged < len(evicted), "the test exercises both merging and discarding"
        assert got.kept[h].tolist() == kept
        assert torch.allclose(got.keys[h], torch.tensor(ref_keys, dtype=torch.float64), atol=1e-6, rtol=0)
        assert torch.allclose(got.values[h], torch.tensor(ref_values, dtype=torch.float64), atol=1e-6, rtol=0)
        assert got.threshold[h].item() == pytest.approx(threshold, abs=1e-12)
    assert as_lists(D2O().keep(prompt, budget)) == as_lists(got.kept)


def test_d2o_in_the_engine_order_observe_budget_compress_equals_the_direct_call(prompt):
    """The engine observes each layer first, budgets across layers, then compresses with the observation."""
    d2o = D2O()
    layers = [prompt, PromptKV(prompt.keys.flip(1), queries=prompt.queries, values=prompt.values)]
    observations = [d2o.observe(p, 24) for p in layers]
    variances = [prompt_attention_variance(p.keys, p.queries) for p in layers]
    budgets = d2o.layer_budgets(observations, 24)
    assert budgets == layer_budgets(variances, 24)
    for layer, observation, budget in zip(layers, observations, budgets):
        staged, direct = d2o.compress(layer, budget, observation), d2o.compress(layer, budget)
        assert as_lists(staged.kept) == as_lists(direct.kept)
        assert torch.equal(staged.keys, direct.keys) and torch.equal(staged.values, direct.values)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_d2o_decode_merge_updates_the_ema_threshold(seed):
    gen = torch.Generator().manual_seed(seed)
    kept_keys, kept_values = torch.randn(2, H, 10, D, generator=gen, dtype=torch.float64)
    evicted_keys, evicted_values = torch.randn(2, H, 1, D, generator=gen, dtype=torch.float64)
    previous = torch.rand(H, generator=gen, dtype=torch.float64) - 0.2
    keys, values, threshold = merge_evicted(kept_keys, kept_values, evicted_keys, evicted_values, previous, 0.7)
    for h in range(H):
        ref_keys, ref_values, ref_threshold, _ = reference_merge(
            kept_keys[h].tolist(),
            kept_values[h].tolist(),
            evicted_keys[h].tolist(),
            evicted_values[h].tolist(),
            previous[h].item(),
            0.7,
        )
        assert threshold[h].item() == pytest.approx(ref_threshold, abs=1e-12)
        assert torch.allclose(keys[h], torch.tensor(ref_keys, dtype=torch.float64), atol=1e-6, rtol=0)
        assert torch.allclose(values[h], torch.tensor(ref_values, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("policy", [make_policy("keydiff"), H2O(), D2O()], ids=["keydiff", "h2o", "d2o"])
def test_short_prompts_are_kept_whole(policy):
    keys, values = torch.randn(2, H, 30, D)
    prompt = PromptKV(keys, queries=torch.randn(H * G, 30, D), values=values)
    assert as_lists(policy.keep(prompt, 40)) == [list(range(30))] * H
    assert as_lists(policy.keep(prompt, 30)) == [list(range(30))] * H


def test_d2o_short_prompt_is_not_merged():
    keys, values = torch.randn(2, H, 30, D)
    merged = D2O().compress(PromptKV(keys, queries=torch.randn(H * G, 30, D), values=values), 30)
    assert merged.keys is None and merged.values is None and merged.threshold is None
    assert merged.scores.shape == (H, 30), "its scores are carried into decode"


def test_d2o_decode_pass_evicts_by_carried_scores_and_merges_against_the_carried_threshold(prompt):
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(H, L, generator=gen, dtype=torch.float64) * 5
    previous = torch.rand(H, generator=gen, dtype=torch.float64) - 0.2
    cache = PromptKV(prompt.keys, values=prompt.values, scores=scores, threshold=previous)
    got = D2O().compress(cache, 24)
    for h in range(H):
        kept = reference_heavy_hitters(scores[h].tolist(), 24, 6, 4)
        evicted = [p for p in range(L) if p not in kept]
        keys, values = prompt.keys[h].tolist(), prompt.values[h].tolist()
        ref_keys, ref_values, threshold, _ = reference_merge(
            [keys[p] for p in kept],
            [values[p] for p in kept],
            [keys[p] for p in evicted],
            [values[p] for p in evicted],
            previous[h].item(),
            0.7,
        )
        assert got.kept[h].tolist() == kept
        assert got.scores[h].tolist() == [scores[h, p].item() for p in kept]
        assert torch.allclose(got.keys[h], torch.tensor(ref_keys, dtype=torch.float64), atol=1e-6, rtol=0)
        assert torch.allclose(got.values[h], torch.tensor(ref_values, dtype=torch.float64), atol=1e-6, rtol=0)
        assert got.threshold[h].item() == pytest.approx(threshold, abs=1e-12)


def test_d2o_without_merging_keeps_the_same_tokens_unchanged(prompt):
    merged, evicted_only = D2O().compress(prompt, 24), D2O(merge=False).compress(prompt, 24)
    assert as_lists(evicted_only.kept) == as_lists(merged.kept)
    assert evicted_only.keys is None and evicted_only.values is None
