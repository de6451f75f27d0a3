"""What both kvpolicy backends add to their platform's attention impl: the dispatch of a step.

``KVPolicyAttention`` is mixed in before the platform's impl class, so
``super()`` is vLLM's own attention (stock rows, steps with no kvpolicy work).
A step (``step.py``) arrives on the metadata as ``step``; each mode's step runs
on its path (``modes/``): a relocating step on the per-head path, a selecting
one on the selection path, a score-sharing one (PoD) on the sharing path, all
over the impl's ``KVOps``.
"""

from __future__ import annotations

import functools

from kvpolicy.vllm.internals import extract_layer_index, get_forward_context
from kvpolicy.vllm.modes.relocate_path import PerHeadPath
from kvpolicy.vllm.modes.select import SelectionPath
from kvpolicy.vllm.modes.share import SharingPath
from kvpolicy.vllm.ops import KVOps
from kvpolicy.vllm.stage import STAGE
from kvpolicy.vllm.state import WORKER_STATE
from kvpolicy.vllm.step import RelocatingStep, SelectingStep, SharingStep, Step


@functools.cache
def layer_index(layer_name: str) -> int:
    """The index of an attention layer within this worker's stage, parsed once per name: every layer
    asks at every step."""
    return extract_layer_index(layer_name) - STAGE.first_layer


def step_of(metadata) -> Step | None:
    return getattr(metadata, "step", None)


class KVPolicyAttention:
    """Mixin: per-head, selection and sharing paths over the impl's ops, the platform's impl (``super()``) for the rest."""

    def use_ops(self, ops: KVOps) -> None:
        WORKER_STATE.ops = type(ops).__name__
        self.per_head = PerHeadPath(ops)
        self.selection = SelectionPath(ops)
        self.sharing = SharingPath(ops)

    @staticmethod
    def _layer_metadata(layer):
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata.get(layer.layer_name)
        return metadata

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        step = step_of(self._layer_metadata(layer))
        if isinstance(step, RelocatingStep) and step.per_head is not None:
            self._write_stock(layer, key, value, kv_cache, slot_mapping, step.platform_layout_tokens)
            self.per_head.write(layer, layer_index(layer.layer_name), key, value, kv_cache, step.per_head)
        elif isinstance(step, SharingStep) and step.shared is not None:
            self._write_stock(layer, key, value, kv_cache, slot_mapping, step.stock.token_idx)
            self.sharing.write(layer, layer_index(layer.layer_name), key, value, step.shared)
        elif isinstance(step, SelectingStep) and step.offloaded is not None:
            self._write_stock(layer, key, value, kv_cache, slot_mapping, step.resident.token_idx)
            self.selection.write(layer, layer_index(layer.layer_name), key, value, step.offloaded)
        else:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def _write_stock(self, layer, key, value, kv_cache, slot_mapping, token_idx) -> None:
        """The platform's own cache write, for the rows in vLLM's layout."""
        if token_idx.numel():
            super().do_kv_cache_update(layer, key[token_idx], value[token_idx], kv_cache, slot_mapping[token_idx])

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        step = step_of(attn_metadata)

        def stock():
            return super(KVPolicyAttention, self).forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )

        if step is None:
            return stock()
        layer_idx = layer_index(layer.layer_name)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        if isinstance(step, SelectingStep):
            self.selection.attend(layer, layer_idx, query, out, kv_cache, step, stock)
            return output
        if isinstance(step, SharingStep):
            if step.shared is None:
                output = stock()
            else:
                self.sharing.attend(layer, layer_idx, query, out, kv_cache, step)
            self.sharing.after_attention(layer, layer_idx, step)
            return output
        if step.per_head is None and not step.summed:
            output = stock()
        else:
            self.per_head.attend(layer, layer_idx, query, out, kv_cache, step)
        self.per_head.after_attention(layer, layer_idx, query, kv_cache, step)
        return output
