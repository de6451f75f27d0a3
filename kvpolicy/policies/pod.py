"""PoD: proximal tokens over distant tokens, with inter-layer sharing of the distant tokens' scores.

Every token attends to its proximal tokens (the first ``sink_tokens``, the last ``recent_tokens``) with its own
layer's keys, and to the distant ones between with the logits of the lowest layer of its block (layers grouped
offline by attention similarity) and its own values, eq. 4's gate making that one softmax. Only a block's lowest
layer needs the distant keys; the others free them. Our readings: docs/policies.md.

Paper: *Compressing KV Cache for Long-Context LLM Inference with Inter-Layer Attention Similarity*,
arXiv:2412.02252. Parameters: ``sink_tokens`` (16), ``recent_tokens`` (1008), ``tau`` (None: never skip),
``groups`` and ``delta`` (the offline grouping, and a threshold to regroup it at).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpolicy.policies.base import Mode, ModelShape, Policy
from kvpolicy.policies.options import existing_grouping, gate_threshold, not_negative, option, unit_interval

#: The grouping shipped for the default model (``python -m kvpolicy.offline.calibrate_pod``).
DEFAULT_GROUPS = Path(__file__).resolve().parent.parent / "data" / "pod_groups_smollm2.json"


def js_similarity(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """One minus the Jensen-Shannon divergence (base 2) of distributions along the last dim: 1 is identical."""
    p, q = p.double(), q.double()
    m = (p + q) / 2

    def kl(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (a / m).log2(), torch.zeros_like(a)).sum(dim=-1)

    return 1 - (kl(p) + kl(q)) / 2


def group_layers(similarity: torch.Tensor, delta: float) -> list[list[list[int]]]:
    """Algorithm 1 per head: ``similarity`` [heads, layers, layers]; a layer joins the current block when it is
    at least ``delta`` similar to every layer already in it, else it starts a new block."""
    groups = []
    for sim in similarity:
        blocks = [[0]]
        for layer in range(1, sim.shape[0]):
            if all(sim[layer, other] >= delta for other in blocks[-1]):
                blocks[-1].append(layer)
            else:
                blocks.append([layer])
        groups.append(blocks)
    return groups


@dataclass(frozen=True)
class LayerGroups:
    """The offline grouping of one model: ``blocks[h]`` are KV head ``h``'s blocks of consecutive layers."""

    blocks: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def num_layers(self) -> int:
        return max(layer for head in self.blocks for block in head for layer in block) + 1

    def lowest(self) -> list[list[int]]:
        """[layer][head]: the lowest layer of the block the layer belongs to for that head."""
        table = [[0] * self.num_heads for _ in range(self.num_layers)]
        for head, blocks in enumerate(self.blocks):
            for block in blocks:
                for layer in block:
                    table[layer][head] = block[0]
        return table

    def keeps_distant_keys(self) -> list[list[bool]]:
        """[layer][head]: whether the (layer, head) is the lowest of its block, the only pairs that keep distant keys."""
        return [[low == layer for low in row] for layer, row in enumerate(self.lowest())]

    def reused(self) -> set[tuple[int, int]]:
        """The (layer, head) pairs whose distant logits some layer above reads."""
        return {(low, head) for layer, row in enumerate(self.lowest()) for head, low in enumerate(row) if low != layer}

    def shared_fraction(self) -> float:
        """Share of (layer, head) pairs that reuse a lower layer's scores, i.e. keep no distant keys."""
        shared = sum(not keeps for row in self.keeps_distant_keys() for keeps in row)
        return shared / (self.num_layers * self.num_heads)

    @classmethod
    def single_layers(cls, num_layers: int, num_heads: int) -> LayerGroups:
        """Every layer its own block: nothing is shared (PoD equals the full cache)."""
        return cls(tuple(tuple((layer,) for layer in range(num_layers)) for _ in range(num_heads)))

    @classmethod
    def of(cls, blocks) -> LayerGroups:
        return cls(tuple(tuple(tuple(int(layer) for layer in block) for block in head) for head in blocks))

    @classmethod
    def load(cls, path: str | Path, delta: float | None = None) -> LayerGroups:
        """The file's blocks, or, with ``delta``, Algorithm 1 rerun on the similarity the file was grouped from."""
        grouping = json.loads(Path(path).read_text())
        if delta is None:
            return cls.of(grouping["blocks"])
        if "similarity" not in grouping:
            raise ValueError(
                f"{path} holds no similarity to regroup at delta {delta:g}; make it with "
                "`python -m kvpolicy.offline.calibrate_pod --model MODEL --out PATH`, or drop --kv-pod-delta"
            )
        return cls.of(group_layers(torch.tensor(grouping["similarity"], dtype=torch.float64), delta))


@dataclass(frozen=True)
class PoD(Policy):
    """Which tokens are proximal, and which layers keep distant keys (``LayerGroups`` from ``groups``)."""

    name = "pod"
    mode = Mode.SHARE
    needs_budget = False
    sink_tokens: int = option(16, "the proximal tokens at the start, the paper's n_s", check=not_negative, strict=False)
    recent_tokens: int = option(
        1008,
        "the recent proximal tokens, n_r (1/8 of the default model's 8K context, as the paper's 4096 of 32K)",
        check=not_negative,
    )
    tau: float | None = option(
        None,
        "a layer skips the distant tokens for a query head when the proximal share of eq. 4's gate is at least "
        "this (the paper's 0.7 trades 5% quality for 25% of the distant compute; default: never)",
        flag="pod_tau",
        check=gate_threshold,
    )
    groups: str | None = option(
        None,
        "the layer blocks of `python -m kvpolicy.offline.calibrate_pod --model MODEL --out PATH` (default: the ones "
        "shipped for SmolLM2-135M; another model's shape is refused with that command)",
        flag="pod_groups",
        check=existing_grouping,
    )
    delta: float | None = option(
        None,
        "regroup the grouping's similarity with Algorithm 1 at this threshold: lower shares more layers and frees "
        "more memory, higher answers more (the shipped grouping is at 0.65, the paper's is 0.5; default: the "
        "grouping's blocks as they are)",
        flag="pod_delta",
        check=unit_interval,
    )

    def layer_groups(self) -> LayerGroups:
        return LayerGroups.load(self.groups or DEFAULT_GROUPS, self.delta)

    def check_model(self, model: ModelShape) -> None:
        """The layer grouping must be the model's: one block list per KV head covering every layer."""
        if model.tensor_parallel > 1:
            raise ValueError("--kv-policy pod does not support tensor parallelism yet; drop --tensor-parallel-size")
        groups = self.layer_groups()
        if (groups.num_layers, groups.num_heads) != (model.num_layers, model.num_kv_heads):
            raise ValueError(
                f"the PoD layer grouping {self.groups or 'shipped for SmolLM2-135M'} is for {groups.num_layers} "
                f"layers x {groups.num_heads} KV heads, and {model.name} has {model.num_layers} x "
                f"{model.num_kv_heads}; run `python -m kvpolicy.offline.calibrate_pod --model {model.name} --out PATH` "
                "and pass --kv-pod-groups PATH"
            )

    def distant_range(self, num_tokens: int) -> tuple[int, int]:
        """[start, end) of a prompt's distant tokens: between the sinks and the recent window (may be empty)."""
        start = min(self.sink_tokens, num_tokens)
        return start, max(start, num_tokens - self.recent_tokens)

    def saved_fraction(self, groups: LayerGroups, num_tokens: int) -> float:
        """Share of a request's K+V bytes PoD frees at ``num_tokens``: the distant keys of the shared (layer, head) pairs."""
        start, end = self.distant_range(num_tokens)
        return groups.shared_fraction() * (end - start) / (2 * num_tokens) if num_tokens else 0.0
