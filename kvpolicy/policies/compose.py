"""A token-selecting policy is a scorer and an allocator, composed.

A ``Scorer`` says which positions a head always keeps (``Split``) and scores the others, declaring what it
reads (``Inputs``); a ``LayerAllocator`` turns the budget into this layer's capacity and a
``HeadAllocator`` spreads it over the heads, each keeping its best-scored tokens; a ``Rewrite`` changes the
kept tokens' K/V after the choice; the ``Schedule`` says when the engine applies the policy. ``compose``
makes a policy class of them whose dataclass fields are its parts' options:
``compose("adasnap", ObservationWindow(), heads=AdaKV())`` takes ``window``, ``pool_kernel`` and ``alpha``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any, ClassVar

import torch

from kvpolicy.policies.base import CompressedKV, Inputs, PromptKV, RelocatingPolicy, Schedule


@dataclass(frozen=True)
class Split:
    """How a head's budget splits: the first ``sinks`` and last ``recent`` positions are kept as they are;
    ``reserved`` tokens of the budget are theirs (SnapKV reserves its whole window even when fewer window
    queries were observed), and the rest is chosen by score among the positions between them."""

    sinks: int
    recent: int
    reserved: int


@dataclass(frozen=True)
class Scorer:
    """Scores a layer's tokens per KV head, higher kept first. ``carries_scores``: the scores go on with
    the kept tokens to the next compression (accumulated attention, which decode adds to)."""

    reads: ClassVar[Inputs] = Inputs()
    carries_scores: ClassVar[bool] = False

    def split(self, prompt: PromptKV, budget: int) -> Split | None:
        """The positions kept unscored; None when the budget leaves nothing to choose (keep the prompt)."""
        return Split(0, 0, 0)

    def scores(self, prompt: PromptKV, observation: Any = None) -> torch.Tensor:
        """[kv_heads, n] float scores of positions ``0 .. n - 1``, n covering every position before the
        split's recent ones."""
        raise NotImplementedError

    def observe(self, prompt: PromptKV) -> Any:
        """What a layer allocator that budgets across layers needs of this layer (and ``scores`` reuses)."""
        return None


@dataclass(frozen=True)
class LayerAllocator:
    """The layer's share of the budget. ``across_layers``: it needs every layer's ``observe`` first."""

    across_layers: ClassVar[bool] = False

    def layer_budgets(self, observations: list[Any], budget: int) -> list[int]:
        return [budget] * len(observations)

    def capacity(self, prompt: PromptKV, capacity: int, candidates: int) -> int:
        """This layer's tokens per head chosen by score, from the mean ``capacity`` over ``candidates``."""
        return capacity

    def most_kept(self, budget: int) -> int:
        """The most tokens a head of one layer keeps: the budget, one more for rounding."""
        return budget + 1


@dataclass(frozen=True)
class SameBudget(LayerAllocator):
    """Every layer keeps the budget it is given."""


@dataclass(frozen=True)
class HeadAllocator:
    """How many scored tokens each head keeps of the layer's capacity. ``on_device``: the counts depend on
    the scores, so the engine takes them as a device tensor (``device_counts``) in every layer and reads all
    layers' back at once, after the last (``TokenSelector.settle``), not once a layer."""

    on_device: ClassVar[bool] = False

    def counts(self, prompt: PromptKV, scores: torch.Tensor, capacity: int) -> list[int]:
        raise NotImplementedError

    def device_counts(self, prompt: PromptKV, scores: torch.Tensor, capacity: int) -> torch.Tensor:
        """``counts`` as an int64 tensor where the scores are, for allocators ``on_device``."""
        raise NotImplementedError


@dataclass(frozen=True)
class UniformHeads(HeadAllocator):
    """Every head keeps the same count."""

    def counts(self, prompt: PromptKV, scores: torch.Tensor, capacity: int) -> list[int]:
        return [capacity] * prompt.num_heads


@dataclass(frozen=True)
class Rewrite:
    """Changes the kept tokens' K/V once they are chosen."""

    def apply(self, prompt: PromptKV, kept: list[torch.Tensor], scores: torch.Tensor | None) -> CompressedKV:
        raise NotImplementedError


@dataclass
class HeadChoice:
    """What one layer keeps, before the kept positions are picked. ``split`` None: every position;
    ``candidates`` None: the split's alone; else each head's ``counts[h]`` best of ``candidates``, the scores
    of the positions between the split's sinks and recent ones. ``carried``: scores that go on with the kept
    tokens. Taken while the layer's queries are at hand (``TokenSelector.observe``), ``counts`` may be a
    device tensor until ``settle`` reads every layer's back in one read."""

    split: Split | None
    candidates: torch.Tensor | None = None
    counts: torch.Tensor | list[int] | None = None
    carried: torch.Tensor | None = None


def unscored(split: Split, length: int, device: torch.device) -> torch.Tensor:
    """The positions a split keeps unscored, ascending: its sinks, then its recent tokens."""
    return torch.cat(
        [torch.arange(split.sinks, device=device), torch.arange(length - split.recent, length, device=device)]
    )


def keep_best(scores: torch.Tensor, counts: list[int], split: Split, length: int) -> list[torch.Tensor]:
    """Each head's ``counts[h]`` best-scored positions (ties to the earlier one) and the split's, ascending.

    ``scores``: [kv_heads, candidates], the positions between the split's sinks and recent tokens."""
    fixed = unscored(split, length, scores.device)
    ranked = scores.argsort(dim=-1, descending=True, stable=True)
    if len(set(counts)) == 1:
        best = ranked[:, : counts[0]] + split.sinks
        return list(torch.cat([best, fixed.expand(len(counts), -1)], dim=1).sort(dim=-1).values.unbind(0))
    return [torch.cat([ranked[h, :n] + split.sinks, fixed]).sort().values for h, n in enumerate(counts)]


@dataclass(frozen=True)
class TokenSelector(RelocatingPolicy):
    """A scorer and allocators (``parts``); made by ``compose``, whose fields are the parts' options.

    An instance holds its parts with its own options as ``scorer``, ``layers``, ``heads`` and ``rewrite``.
    """

    parts: ClassVar[dict[str, Any]]

    def __post_init__(self) -> None:
        for role, part in self.parts.items():
            if part is not None:
                part = replace(part, **{f.name: getattr(self, f.name) for f in fields(part)})
            object.__setattr__(self, role, part)

    def compress(self, prompt: PromptKV, budget: int, observation: Any = None) -> CompressedKV:
        choice = observation if isinstance(observation, HeadChoice) else self._choice(prompt, budget, observation)
        length = prompt.num_tokens
        if choice.split is None:
            threshold = None if self.rewrite is None else prompt.threshold
            return CompressedKV(self.keep_all(prompt), scores=choice.carried, threshold=threshold)
        if choice.candidates is None:  # nothing left to choose by score
            fixed = unscored(choice.split, length, prompt.keys.device)
            return CompressedKV([fixed for _ in range(prompt.num_heads)])
        kept = keep_best(choice.candidates, choice.counts, choice.split, length)
        kept_scores = None if choice.carried is None else choice.carried.gather(1, torch.stack(kept))
        if self.rewrite is None:
            return CompressedKV(kept, scores=kept_scores)
        return self.rewrite.apply(prompt, kept, kept_scores)

    def _choice(self, prompt: PromptKV, budget: int | None, observation: Any, on_device: bool = False) -> HeadChoice:
        scorer, length = self.scorer, prompt.num_tokens
        carried = scorer.scores(prompt, observation) if scorer.carries_scores else None
        split = None if budget is None or length <= budget else scorer.split(prompt, budget)
        if split is None or (budget == split.reserved and carried is None):
            return HeadChoice(split, carried=carried)
        scores = carried if carried is not None else scorer.scores(prompt, observation)
        candidates = scores[:, split.sinks : length - split.recent]
        capacity = self.layers.capacity(prompt, budget - split.reserved, length - split.reserved)
        allocate = self.heads.device_counts if on_device else self.heads.counts
        return HeadChoice(split, candidates, allocate(prompt, candidates, capacity), carried)

    def observe(self, prompt: PromptKV, budget: int | None) -> Any:
        if not self.heads.on_device:
            return self.scorer.observe(prompt)
        return self._choice(prompt, budget, None, on_device=True)

    @property
    def observes_every_layer(self) -> bool:
        return self.layers.across_layers or self.heads.on_device

    def settle(self, observations: list[Any], budget: int) -> list[tuple[int, Any]]:
        if not self.heads.on_device:
            return super().settle(observations, budget)
        pending = [choice for choice in observations if choice.counts is not None]
        if pending:  # the prompt's one host read: every layer's per-head counts, which size its pages
            for choice, counts in zip(pending, torch.stack([choice.counts for choice in pending]).tolist()):
                choice.counts = counts
        return [(budget, choice) for choice in observations]

    def layer_budgets(self, observations: list[Any], budget: int) -> list[int]:
        return self.layers.layer_budgets(observations, budget)

    def most_kept(self, budget: int) -> int:
        return self.layers.most_kept(budget)


def compose(
    name: str,
    scorer: Scorer,
    *,
    heads: HeadAllocator = UniformHeads(),
    layers: LayerAllocator = SameBudget(),
    rewrite: Rewrite | None = None,
    per_chunk: bool = False,
    in_decode: bool = False,
    class_name: str,
    module: str,
    doc: str,
) -> type[TokenSelector]:
    """The policy ``name``: ``scorer``'s scores, ``layers``' and ``heads``' counts, ``rewrite``'s K/V,
    applied at prompt end, and also per prompt chunk and in decode as asked. Its fields are the parts'
    options, with the parts' values as defaults."""
    if in_decode and not isinstance(heads, UniformHeads):
        raise ValueError(f"{name}: a policy that evicts in decode keeps the same count in every head")
    if heads.on_device and layers.across_layers:
        raise ValueError(f"{name}: head counts settled after the last layer need the layer's capacity before it")
    parts = {"scorer": scorer, "layers": layers, "heads": heads, "rewrite": rewrite}
    options = [
        (f.name, f.type, field(default=getattr(part, f.name), metadata=f.metadata))
        for part in parts.values()
        if part is not None
        for f in fields(part)
    ]
    names = [option[0] for option in options]
    if len(set(names)) != len(names):
        raise ValueError(f"{name}: two parts have an option of the same name ({names})")
    namespace = {
        "name": name,
        "parts": parts,
        "inputs": scorer.reads,
        "schedule": Schedule(per_chunk, in_decode, layers.across_layers),
        "__doc__": doc,
        "__module__": module,
    }
    return make_dataclass(class_name, options, bases=(TokenSelector,), namespace=namespace, frozen=True)
