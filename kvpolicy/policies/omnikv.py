"""OmniKV: a few filter layers choose, at each decode step, the context the layers after them attend to.

Nothing is dropped: layers below ``dense_layers``, each filter layer and the layer right after it attend
to the whole context (eq. 2); every other layer attends only to the pages the last filter layer before it
selected this step by the decode token's attention (eq. 1, 3-4), which makes long-context decode cheaper.
Selection is by page, as a paged cache is read; the readings we chose and the budget as Mem%:
docs/policies.md#omnikv.

Paper: *OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs* (ICLR 2025, no arXiv version).
Parameters: ``filter_layers`` (2, 9, 15 for the default model), ``dense_layers`` (2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvpolicy.policies.base import Mode, ModelShape, Policy
from kvpolicy.policies.options import increasing_layers, not_negative, option

SELECTORS = ("last", "uniform", "exponential")


def selector_weights(selector: str, window: int, device: torch.device) -> torch.Tensor:
    """The window weights alpha of §4.2, oldest query first, float64."""
    if selector == "last":
        weights = torch.zeros(window, dtype=torch.float64, device=device)
        weights[-1] = 1.0
        return weights
    if selector == "uniform":
        return torch.ones(window, dtype=torch.float64, device=device)
    if selector == "exponential":
        return 2.0 ** (torch.arange(window, dtype=torch.float64, device=device) - window)
    raise ValueError(f"unknown OmniKV selector {selector!r}; choose one of {', '.join(SELECTORS)}")


def context_scores(
    queries: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor, selector: str = "last"
) -> torch.Tensor:
    """Eq. (3)-(4) for a batch of sequences: [batch, n] scores, 0 past each sequence's length.

    ``queries``: [batch, q_heads, window, D], the last ``window`` tokens of each
    sequence (query head q belongs to KV head ``q // (q_heads // kv_heads)``);
    ``keys``: each sequence's keys in position order, valid up to ``lengths``
    [batch]: [batch, kv_heads, n, D], or [batch, kv_heads, pages, page_size, D]
    with n = pages * page_size (any strides: a paged cache's keys as they lie).
    Window queries are causal: the query at position p sees keys up to p.
    """
    if keys.dim() == 4:
        keys = keys.unsqueeze(2)
    batch, q_heads, window, dim = queries.shape
    kv_heads, num_pages, page_size = keys.shape[1:4]
    width = num_pages * page_size
    grouped = queries.reshape(batch, kv_heads, 1, q_heads // kv_heads * window, dim).to(keys.dtype)
    per_page = grouped @ keys.transpose(-1, -2)  # [batch, kv_heads, pages, group * window, page_size]
    logits = per_page.permute(0, 1, 3, 2, 4).reshape(batch, q_heads, window, width).double() / math.sqrt(dim)
    query_pos = lengths[:, None] - window + torch.arange(window, device=lengths.device)[None, :]
    hidden = torch.arange(width, device=lengths.device)[None, None, :] > query_pos[:, :, None]
    weights = logits.masked_fill(hidden[:, None], float("-inf")).softmax(dim=-1)
    return torch.einsum("w,bwn->bn", selector_weights(selector, window, weights.device), weights.amax(dim=1))


def page_sums(scores: torch.Tensor, page_size: int) -> torch.Tensor:
    """[batch, pages]: each page's summed token scores, ``scores`` [batch, n] (0 past each row's length)."""
    rows, n = scores.shape
    padded = scores.new_zeros(rows, -(-n // page_size) * page_size)
    padded[:, :n] = scores
    return padded.view(rows, -1, page_size).sum(dim=-1)


@dataclass(frozen=True)
class PageChoice:
    """OmniKV's page choice for a batch of sequences, all of it that the scores do not decide: made once
    per step on the host (numpy), then ``choose`` in every filter layer, where the scores are.

    Row ``r`` of ``lengths`` tokens keeps the best ``counts[r] = ceil(budgets[r] / page_size)``
    of its ``num_pages[r]`` pages, always including the last (current) one; every page when
    they are not more than that. The counts size the sparse layers' call, which the host builds;
    which pages fill it is the device's to pick, so no score is read back.
    """

    num_pages: np.ndarray
    counts: np.ndarray
    kept: np.ndarray  # [rows, most kept]: entry j of row r holds a page (j < counts[r])
    drops: bool  # some row leaves pages out: only then do the scores decide anything

    @classmethod
    def of(cls, lengths: np.ndarray, page_size: int, budgets: list[int]) -> PageChoice:
        num_pages = -(-np.asarray(lengths, dtype=np.int64) // page_size)
        counts = np.minimum(-(-np.asarray(budgets, dtype=np.int64) // page_size), num_pages)
        return cls(num_pages, counts, np.arange(counts.max()) < counts[:, None], bool((counts < num_pages).any()))

    def choose(
        self, page_scores: torch.Tensor, kept: torch.Tensor | None = None, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each row's kept page indices, ascending, in its first ``counts[r]`` entries, then zeros,
        [rows, most kept], where ``page_scores`` [rows, pages] (summed token scores, ``page_sums``) are.
        Among equal scores the lower page wins. ``kept`` and ``last`` (each row's current page): this
        choice's on the scores' device, when the caller has them there already."""
        device = page_scores.device
        kept = torch.from_numpy(self.kept).to(device, non_blocking=True) if kept is None else kept
        last = torch.from_numpy(self.num_pages - 1).to(device, non_blocking=True) if last is None else last
        width = page_scores.shape[1]
        # The current page is always kept; the others compete, pages past the row's last never.
        pages = torch.arange(width, device=device)
        candidates = torch.where(pages[None, :] >= last[:, None], -math.inf, page_scores)
        ranked = torch.sort(-candidates, dim=1, stable=True).indices[:, : kept.shape[1] - 1]
        # Past a row's count, a value above every page sorts last; the current page sorts after the chosen ones.
        ranked = torch.where(kept[:, 1:], ranked, width)
        chosen = torch.sort(torch.cat([ranked, last[:, None]], dim=1), dim=1).values
        return torch.where(kept, chosen, 0)


@dataclass(frozen=True)
class OmniKV(Policy):
    """``omnikv``: sparse decode attention behind filter layers; the cache stays whole.

    ``filter_layers``: the layers whose last-token attention selects the
    context (``python -m kvpolicy.offline.calibrate`` proposes them). ``dense_layers``:
    layers below it always attend to everything.
    """

    name = "omnikv"
    mode = Mode.SELECT
    filter_layers: tuple[int, ...] = option(
        (2, 9, 15),
        "the layers that select the context of the layers after them, e.g. 2,8,18 (the default is calibrated "
        "for SmolLM2-135M; `python -m kvpolicy.offline.calibrate` proposes them for a model)",
        check=increasing_layers,
        strict=False,
    )
    dense_layers: int = option(2, "layers below this always attend to everything", check=not_negative, strict=False)

    def source_layers(self, num_layers: int) -> list[int | None]:
        """Per layer: the filter layer whose selection it attends to, or None for full attention."""
        if not self.filter_layers:
            raise ValueError("omnikv needs filter layers (--kv-filter-layers)")
        bad = [f for f in self.filter_layers if not self.dense_layers <= f < num_layers]
        if bad:
            raise ValueError(
                f"--kv-filter-layers {bad} out of range: filter layers must be in "
                f"[--kv-dense-layers {self.dense_layers}, {num_layers - 1}] for this {num_layers}-layer model"
            )
        sources: list[int | None] = []
        for layer in range(num_layers):
            before = [f for f in self.filter_layers if f < layer - 1]
            dense = layer < self.dense_layers or layer in self.filter_layers or layer - 1 in self.filter_layers
            sources.append(None if dense or not before else max(before))
        return sources

    def check_model(self, model: ModelShape) -> None:
        """The filter layers must be the model's, and a ``--kv-ratio`` must leave the sparse layers something
        at the context limit."""
        try:
            self.source_layers(model.num_layers)
        except ValueError as exc:
            raise ValueError(f"{exc}; run `python -m kvpolicy.offline.calibrate --model {model.name}`") from None
        if model.ratio is not None:
            self.sparse_budget(model.ratio, model.max_model_len, model.num_layers)

    def sparse_budget(self, mem: float, context_len: int, num_layers: int) -> int:
        """Tokens a sparse layer attends to so that the cache read is ``mem`` of the whole (paper §5)."""
        dense = (2 * len(self.filter_layers) + self.dense_layers) / num_layers
        if mem <= dense:
            raise ValueError(
                f"Mem% {mem:.0%} is below what the full-attention layers alone read ({dense:.0%}); "
                "raise --kv-ratio or use fewer filter/dense layers"
            )
        return max(1, math.ceil((mem - dense) / (1 - dense) * context_len))
