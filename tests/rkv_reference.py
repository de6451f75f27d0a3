"""A plain reference for R-KV's scores, written from the paper (arXiv 2505.24133) and its code's reading, with loops.

No code shared with ``kvpolicy.policies``: importance is each window query's softmax, over the tokens before
the window, of the largest logit among a KV head's query heads, averaged over the window and max-pooled;
redundancy is the softmax over tokens of the column means of the keys' cosine matrix, its diagonal and each
row's last entry above the threshold (entry 0 when none) zeroed; the score is ``lam * I - (1 - lam) * R``.
"""

import math

import torch


def reference_importance(keys, queries, kernel):
    H, length, D = keys.shape
    G = queries.shape[0] // H
    window = queries.shape[1]
    prefix = length - window
    rows = []
    for h in range(H):
        mean = [0.0] * prefix
        for i in range(window):
            logits = [
                max(float(torch.dot(queries[h * G + g, i].double(), keys[h, j].double())) for g in range(G))
                / math.sqrt(D)
                for j in range(prefix)
            ]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            for j in range(prefix):
                mean[j] += exps[j] / sum(exps) / window
        rows.append(
            [
                max(mean[k] for k in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= k < prefix)
                for j in range(prefix)
            ]
        )
    return rows


def reference_redundancy(keys, threshold):
    H, n, _ = keys.shape
    rows = []
    for h in range(H):
        unit = [keys[h, j].double() / keys[h, j].double().norm() for j in range(n)]
        similarity = [[0.0 if i == j else float(torch.dot(unit[i], unit[j])) for j in range(n)] for i in range(n)]
        for row in similarity:
            above = [j for j in range(n) if row[j] > threshold]
            row[above[-1] if above else 0] = 0.0
        column = [sum(similarity[i][j] for i in range(n)) / n for j in range(n)]
        top = max(column)
        exps = [math.exp(c - top) for c in column]
        rows.append([e / sum(exps) for e in exps])
    return rows


def reference_rkv_scores(keys, queries, kernel, lam, threshold):
    importance = reference_importance(keys, queries, kernel)
    redundancy = reference_redundancy(keys, threshold)
    return torch.tensor(
        [[lam * i - (1 - lam) * r for i, r in zip(imp, red)] for imp, red in zip(importance, redundancy)],
        dtype=torch.float64,
    )
