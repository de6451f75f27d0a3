"""What both kvpolicy backends add to their platform's attention impl: running a step's layer on its path.

``KVPolicyAttention`` is mixed in before the platform's impl class, so
``super()`` is vLLM's own attention. A step (``step.py``) arrives on the
metadata as ``step`` and carries the path of the mode that built it
(``modes/``): the per-head path for a relocating step, the selection path for
a selecting one, the sharing path for PoD's. The layer hands it the platform's
own write and attention for the rows the step leaves to vLLM; a batch with no
step is vLLM's alone.
"""

from __future__ import annotations

from kvpolicy.vllm.internals import get_forward_context
from kvpolicy.vllm.worker.diagnostics import sync_scope
from kvpolicy.vllm.worker.step import Step


def step_of(metadata) -> Step | None:
    return getattr(metadata, "step", None)


class KVPolicyAttention:
    """Mixin: a step's layer on its path, the platform's impl (``super()``) for the rest."""

    @staticmethod
    def _layer_metadata(layer):
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata.get(layer.layer_name)
        return metadata

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        step = step_of(self._layer_metadata(layer))
        platform = super().do_kv_cache_update
        if step is None:
            platform(layer, key, value, kv_cache, slot_mapping)
            return

        def platform_write(token_idx=None):
            if token_idx is None:
                platform(layer, key, value, kv_cache, slot_mapping)
            elif token_idx.numel():
                platform(layer, key[token_idx], value[token_idx], kv_cache, slot_mapping[token_idx])

        with sync_scope(step.path.worker.diagnostics, "write"):
            step.write(layer, key, value, kv_cache, platform_write)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        step = step_of(attn_metadata)

        def platform_attend():
            return super(KVPolicyAttention, self).forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )

        if step is None:
            return platform_attend()
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        with sync_scope(step.path.worker.diagnostics, "attend"):
            step.attend(layer, query, out, kv_cache, platform_attend)
        return output
