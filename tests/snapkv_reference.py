"""Plain references for the observation-window policies, written from the Ada-KV paper with loops.

No code shared with ``kvpolicy.policies``: per query head and window query a
causal softmax; summed over the window; max-pooled with kernel k (its window
moved ``shift`` tokens back); averaged over a GQA group, or its max; then
top-k per head (SnapKV), layer-wide top-k with the alpha safeguard (Ada-KV),
or pyramidal layer capacities (PyramidKV). Ada-Mix:
KeyDiff's ``-cos(key, mean unit key)`` and the window score, each ranked over
the whole layer, blended.
"""

import math

import torch


def reference_pool(row, kernel, shift=0):
    """Each position's max over ``j - kernel//2 - shift .. j + kernel//2 - shift`` within the row."""
    n = len(row)
    return [
        max(row[i] for i in range(j - kernel // 2 - shift, j + kernel // 2 - shift + 1) if 0 <= i < n) for j in range(n)
    ]


def reference_scores(keys, queries, window, kernel, shift=0, group="mean"):
    H, length, D = keys.shape
    G = queries.shape[0] // H
    prefix = length - window
    scores = torch.zeros(H, prefix, dtype=torch.float64)
    for h in range(H):
        per_query_head = []
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
            per_query_head.append(reference_pool(summed, kernel, shift))
        for j in range(prefix):
            column = [pooled[j] for pooled in per_query_head]
            scores[h, j] = max(column) if group == "max" else sum(p / G for p in column)
    return scores


def best(scores_row, n):
    order = sorted(range(len(scores_row)), key=lambda j: (-scores_row[j], j))
    return sorted(order[:n])


def reference_keep(counts, scores, length, window):
    recent = list(range(length - window, length))
    return [best(scores[h].tolist(), counts[h]) + recent for h in range(len(counts))]


def reference_ada_counts(scores, capacity, alpha):
    H = scores.shape[0]
    flat = [(-float(scores[h, j]), h, j) for h in range(H) for j in range(scores.shape[1])]
    winners = sorted(flat)[: H * capacity]
    counts = [sum(1 for _, h, _ in winners if h == head) for head in range(H)]
    return [round(c * (1 - alpha) + int(capacity * alpha)) for c in counts]


def reference_pyramid(capacity, prefix, layer, layers, beta=20):
    low, high = capacity // beta, 2 * capacity - capacity // beta
    if high >= prefix:
        high, low = prefix, 2 * capacity - prefix
    return round(high - layer * (high - low) / (layers - 1))


def reference_keydiff_scores(keys):
    """``-cos(key, mean unit key)`` per head and position."""
    H, length, D = keys.shape
    scores = torch.zeros(H, length, dtype=torch.float64)
    for h in range(H):
        rows = [[float(x) for x in keys[h, j]] for j in range(length)]
        units = [[x / math.sqrt(sum(y * y for y in row)) for x in row] for row in rows]
        anchor = [sum(u[d] for u in units) / length for d in range(D)]
        norm = math.sqrt(sum(a * a for a in anchor))
        for j, u in enumerate(units):
            scores[h, j] = -sum(x * a for x, a in zip(u, anchor)) / norm
    return scores


def reference_layer_ranks(scores):
    """Each score's place among the layer's, 1 the best, 0 the worst; ties: lower head, then earlier position, higher."""
    H, n = scores.shape
    order = sorted((-float(scores[h, j]), h, j) for h in range(H) for j in range(n))
    ranks = torch.zeros(H, n, dtype=torch.float64)
    for place, (_, h, j) in enumerate(order):
        ranks[h, j] = (H * n - 1 - place) / (H * n - 1)
    return ranks


def reference_mix_scores(keys, queries, window, kernel, mix, combine="blend", shift=0, group="mean"):
    window_ranks = reference_layer_ranks(reference_scores(keys, queries, window, kernel, shift, group))
    keydiff_ranks = reference_layer_ranks(reference_keydiff_scores(keys)[:, : window_ranks.shape[1]])
    if combine == "union":
        pairs = zip(window_ranks.tolist(), keydiff_ranks.tolist())
        return torch.tensor([[max(a, b) for a, b in zip(w, k)] for w, k in pairs], dtype=torch.float64)
    return (1 - mix) * window_ranks + mix * keydiff_ranks
