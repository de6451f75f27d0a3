"""Builds each step's ``Step`` from vLLM's batch, once per step, for every platform.

A platform's metadata builder mixes in ``KVPolicyMetadataBuilder``: after its
own ``build`` it asks the worker's mode for the step, attaches the mode's path
to it (which every attention layer then runs) and lets its ops stage the step's
index tensors; the builder never touches a tensor of the cache. The one
platform-specific thing the mode needs, how the ops will run an attention
call, comes in as a ``Planner``. The worker hook binds the builder to the
worker's state (``bind``); until then, and under ``--kv-policy none``, every
row takes the platform's path.
"""

from __future__ import annotations

from kvpolicy.vllm.internals import attention_layer
from kvpolicy.vllm.worker.diagnostics import sync_scope
from kvpolicy.vllm.worker.modes import ModeState, make_path
from kvpolicy.vllm.worker.modes.base import HostBatch, StepShape
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.state import WorkerState
from kvpolicy.vllm.worker.step import Step, StepPath


class StepBuilder:
    """The steps of one worker's mode, for one platform's cache, ops and planner."""

    def __init__(self, worker: WorkerState, mode: ModeState, path: StepPath, ops: KVOps, shape: StepShape):
        self.worker = worker
        self.mode = mode
        self.path = path
        self.ops = ops
        self.shape = shape

    def build(self, cam) -> Step | None:
        """``cam``: vLLM's ``CommonAttentionMetadata`` of the step. None: every row takes the stock path."""
        step = self.mode.build(HostBatch.of(cam, self.worker.runner), self.shape)
        if step is not None:
            if step.path is None:  # a step the mode made for a path of its own (fixed shapes) keeps it
                step.path = self.path
            self.mode.stage(step, self.ops)
        return step


class KVPolicyMetadataBuilder:
    """Mixin before a platform's metadata builder: its metadata carries the step (``metadata_cls``, a
    subclass of the platform's metadata with a ``step`` field)."""

    metadata_cls: type
    ops: KVOps
    steps: StepBuilder | None = None

    def step_shape(self) -> StepShape:
        """The model and cache this builder's steps are for, and its ops' planner."""
        raise NotImplementedError

    def fixed_decode_rows(self) -> int:
        """The most rows of a decode batch the platform may replay in a full CUDA graph (0: none)."""
        return 0

    def bind(self, worker: WorkerState) -> None:
        """Build steps with the worker's mode (none: every row stays on the platform's path), in fixed
        shapes for the decode batches the platform may replay in full CUDA graphs."""
        worker.ops = type(self.ops).__name__
        mode = worker.mode
        if mode is None:
            self.steps = None
            return
        shape = self.step_shape()
        self.steps = StepBuilder(worker, mode, make_path(mode, self.ops), self.ops, shape)
        rows = self.fixed_decode_rows()
        if rows:
            layer = attention_layer(self.vllm_config, self.layer_names[0])
            device = layer.kv_cache.device
            worker.fixed_decode = mode.enable_fixed_decode(self.ops, shape, rows, layer.impl.head_size, device)

    def warm_up(self) -> None:
        """Compile the ops' kernels before the first request, over the first layer's cache."""
        if self.steps is not None:
            layer = attention_layer(self.vllm_config, self.layer_names[0])
            self.ops.warm_up(layer, layer.kv_cache)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if (
            self.steps is None
            or getattr(self, "is_cross_attention", False)
            or getattr(self, "is_encoder_only_attention", False)
        ):
            return metadata
        with sync_scope(self.steps.worker.diagnostics, "build"):
            step = self.steps.build(common_attn_metadata)
        if step is None:
            return metadata
        return self.metadata_cls(**vars(metadata), step=step)
