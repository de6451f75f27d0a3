"""The score-sharing path (PoD): decode rows attend per KV head with the distant tokens' logits of a lower layer.

A PoD request is read with full attention (stock). After the last layer of
the step that completes it, its tokens move into ``SharedPages`` over the
whole KV buffer: every token in each block's lowest layer, the proximal ones
elsewhere, with the distant values packed two per slot; the connector then
hands back the blocks the layout no longer uses. In decode, each layer
writes the new K/V into the request's main sequences and attends in torch
(``pod.attend_shared``): a block's lowest layer over everything, keeping
its distant logits for the layers above it; those layers over their own
proximal keys plus the shared logits and their own distant values. All
cache reads and writes go through ``KVOps``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvpolicy.policies.pod import LayerGroups, attend_shared, proximal_gate, proximal_logits
from kvpolicy.vllm.ops import KVOps
from kvpolicy.vllm.state import WORKER_STATE
from kvpolicy.vllm.step import SharedBatch, SharingStep


class SharingPath:
    def __init__(self, ops: KVOps):
        self.ops = ops

    @functools.cached_property
    def _groups(self) -> LayerGroups:
        return WORKER_STATE.policy.layer_groups()

    @functools.cached_property
    def _lowest(self) -> np.ndarray:
        """[layer, head]: the lowest layer of the block each (layer, head) belongs to."""
        return np.array(self._groups.lowest())

    @functools.cached_property
    def _shared_from(self) -> np.ndarray:
        """[layer, head]: whether some layer above reuses this (layer, head)'s distant logits."""
        used = np.zeros_like(self._lowest, dtype=bool)
        for layer, head in self._groups.reused():
            used[layer, head] = True
        return used

    def write(self, layer, layer_idx: int, key, value, shared: SharedBatch) -> None:
        """The decode rows' new K/V at the end of their main sequences."""
        pages = WORKER_STATE.page_space().pages
        self.ops.write(layer, pages, key, value, shared.rows, shared.slots[layer_idx])

    def attend(self, layer, layer_idx: int, query, out, kv_cache, step: SharingStep, scale: float) -> None:
        """Stock rows as usual, decode rows per KV head (eq. 3-4)."""
        self.ops.attend(layer, query, out, kv_cache, step.stock)
        if step.shared is not None:
            self._attend_shared(layer, layer_idx, query, out, step.shared, scale)

    def after_attention(self, layer, layer_idx: int, step: SharingStep) -> None:
        """After the last layer, lay out the prompts that completed this step."""
        if step.layouts and layer_idx == len(self._lowest) - 1:
            self._lay_out(layer, step)

    def _attend_shared(self, layer, layer_idx: int, query, out, shared: SharedBatch, scale: float) -> None:
        pages = WORKER_STATE.page_space().pages
        tau = WORKER_STATE.policy.tau
        counters = WORKER_STATE.counters
        heads = len(shared.rows.head_of) // len(shared.requests)
        group = query.shape[1] // heads
        lowest, shared_from = self._lowest[layer_idx], self._shared_from[layer_idx]
        for row, (token, request) in enumerate(zip(shared.token_idx.tolist(), shared.requests)):
            main = request.main_slots(layer_idx)
            keys, values = self.ops.gather(layer, pages, torch.cat(main))
            lengths = [slots.numel() for slots in main]
            keys, values = keys.split(lengths), values.split(lengths)
            start, end = request.distant
            for head in range(heads):
                own = proximal_logits(query[token, head * group : (head + 1) * group], keys[head], scale)
                source = int(lowest[head])
                if source == layer_idx:
                    if shared_from[head] and end > start:
                        shared.distant_logits[row, head, layer_idx] = own[:, start:end]
                    result, _ = attend_shared(own, values[head], None, None)
                else:
                    distant_logits = shared.distant_logits[row, head, source]
                    counters["pod_distant_evaluated"] += group
                    if tau is not None and bool((proximal_gate(own, distant_logits) >= tau).all()):
                        counters["pod_distant_skipped"] += group
                        result, _ = attend_shared(own, values[head], None, None)
                    else:
                        result, skipped = attend_shared(
                            own,
                            values[head],
                            distant_logits,
                            self._distant_values(layer, pages, request, layer_idx, head),
                            tau,
                        )
                        counters["pod_distant_skipped"] += int(skipped.sum())
                out[token, head * group : (head + 1) * group] = result.to(out.dtype)

    def _distant_values(self, layer, pages, request, layer_idx: int, head: int) -> torch.Tensor:
        """A sharing (layer, head)'s distant values in position order, unpacked from their pairs."""
        even, odd = self.ops.gather(layer, pages, request.value_slots(layer_idx, head))
        return torch.stack([even, odd], dim=1).flatten(0, 1)[: request.num_distant]

    def _lay_out(self, layer, step: SharingStep) -> None:
        """Move each completed prompt into its shared layout: every source read before any destination is written."""
        pages = WORKER_STATE.page_space().pages
        read = []
        for plan in step.layouts:
            keys, values = self.ops.gather(layer, pages, plan.tokens.src)
            pairs = plan.values
            if pairs.dst.numel():
                _, even = self.ops.gather(layer, pages, pairs.even)
                _, odd = self.ops.gather(layer, pages, pairs.odd)
            else:
                even = odd = None
            read.append((plan, keys, values, even, odd))
        for plan, keys, values, even, odd in read:
            self.ops.scatter(layer, pages, plan.tokens.dst, keys, values)
            if even is not None:
                self.ops.scatter(layer, pages, plan.values.dst, even, odd)
            WORKER_STATE.counters["pod_layouts"] += 1
