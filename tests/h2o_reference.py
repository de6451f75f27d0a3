"""H2O's prompt scores as plain loops over lists of floats, shared by the H2O/D2O and Ada-Heavy reference tests."""

import math


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def reference_column_sums(keys, queries, q_head):
    """Column sums of one query head's causal softmax attention over the whole prompt."""
    kv_head = q_head // (len(queries) // len(keys))
    length = len(keys[0])
    sums = [0.0] * length
    for i in range(length):
        logits = [dot(queries[q_head][i], keys[kv_head][j]) / math.sqrt(len(keys[0][0])) for j in range(i + 1)]
        peak = max(logits)
        exps = [math.exp(x - peak) for x in logits]
        for j in range(i + 1):
            sums[j] += exps[j] / sum(exps)
    return sums


def reference_h2o_scores(keys, queries):
    group = len(queries) // len(keys)
    per_query_head = [reference_column_sums(keys, queries, q) for q in range(len(queries))]
    return [
        [sum(per_query_head[h * group + g][j] for g in range(group)) / group for j in range(len(keys[0]))]
        for h in range(len(keys))
    ]
