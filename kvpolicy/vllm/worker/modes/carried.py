"""What a policy that evicts in decode (H2O, D2O, streaming, keydiff) carries between a request's compressions.

Budgets and thresholds are a few numbers per layer. The accumulated attention
of H2O and D2O is a score per kept token, updated by every generated token in
every layer: kept per request, a decode step would add each request's new
weights in its own operations (a few kernel launches per request and layer
on a GPU). ``CarriedScores`` keeps every request's scores of a layer as rows
of one tensor where the cache is, so a step adds the whole batch's weights in
one operation per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CarriedState:
    """One request's carried state: per layer its budget, its merge threshold (D2O), and whether it
    carries scores; ``slot``: its row of ``CarriedScores``."""

    budgets: list[int]
    thresholds: list[torch.Tensor | None]
    scored: list[bool]
    slot: int

    @classmethod
    def empty(cls, num_layers: int, slot: int) -> CarriedState:
        return cls([0] * num_layers, [None] * num_layers, [False] * num_layers, slot)


class CarriedScores:
    """Per layer, ``[slots, kv_heads, tokens]`` float64 where the scores are: slot ``s`` holds a request's
    score of each kept token of each head, zeros past the head's length (new tokens start at zero)."""

    def __init__(self, num_layers: int):
        self.layers: list[torch.Tensor | None] = [None] * num_layers
        self.free: list[int] = []
        self.num_slots = 0

    def new_slot(self) -> int:
        if self.free:
            return self.free.pop()
        self.num_slots += 1
        return self.num_slots - 1

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def _room(self, layer: int, heads: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """The layer's tensor with a row for every slot and at least ``width`` tokens (doubling)."""
        scores = self.layers[layer]
        if scores is None or scores.shape[0] < self.num_slots or scores.shape[2] < width:
            old_slots, old_width = (0, 0) if scores is None else (scores.shape[0], scores.shape[2])
            grown = torch.zeros(
                max(self.num_slots, 2 * old_slots),
                heads,
                max(width, 2 * old_width),
                dtype=torch.float64,
                device=like.device,
            )
            if scores is not None:
                grown[:old_slots, :, :old_width] = scores
            self.layers[layer] = scores = grown
        return scores

    def add(self, layer: int, slots: torch.Tensor, weights: torch.Tensor) -> None:
        """Each row's new token's weights ``[rows * kv_heads, n]`` (zeros past each length) added to the scores
        of slot ``slots[row]``, in one operation."""
        rows = slots.numel()
        width = weights.shape[1]
        scores = self._room(layer, weights.shape[0] // rows, width, weights)
        scores[:, :, :width].index_put_((slots,), weights.view(rows, -1, width), accumulate=True)  # rows unique

    def read(self, layer: int, slot: int, length: int) -> torch.Tensor:
        """A slot's scores of the first ``length`` tokens of each head, [kv_heads, length] (a copy)."""
        return self.layers[layer][slot, :, :length].clone()

    def write(self, layer: int, slot: int, scores: torch.Tensor) -> None:
        """A slot's scores after a compression, [kv_heads, kept]: the rest of its row zero."""
        room = self._room(layer, scores.shape[0], scores.shape[1], scores)
        room[slot] = 0
        room[slot, :, : scores.shape[1]] = scores
