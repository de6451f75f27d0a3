"""Builds each step's ``Step`` from vLLM's batch, once per step, for every platform.

A platform's metadata builder calls ``StepBuilder.build`` after its own
``build`` and attaches the result to its metadata; the builder never touches a
tensor of the cache. The one platform-specific thing it needs, how the ops will
run an attention call, comes in as a ``Planner``. What the step holds is the
active mode's to decide (``WorkerState.mode``, ``kvpolicy/vllm/modes/``).
"""

from __future__ import annotations

from kvpolicy.vllm.modes.base import HostBatch, StepShape
from kvpolicy.vllm.state import WORKER_STATE
from kvpolicy.vllm.step import Planner, Step


class StepBuilder:
    """The step of a batch, as the worker's mode builds it for this platform's cache and planner."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        block_size: int,
        max_model_len: int,
        plan: Planner,
        sums_prompts: bool = False,
    ):
        """``sums_prompts``: the ops attend H2O/D2O prompt chunks themselves (``KVOps.prompt_attention``)."""
        self.shape = StepShape(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            queries_per_kv=num_heads // num_kv_heads,
            block_size=block_size,
            max_model_len=max_model_len,
            plan=plan,
            sums_prompts=sums_prompts,
        )

    def build(self, cam) -> Step | None:
        """``cam``: vLLM's ``CommonAttentionMetadata`` of the step. None: every row takes the stock path."""
        mode = WORKER_STATE.mode
        if mode is None:
            return None
        return mode.build(HostBatch.of(cam, WORKER_STATE.runner), self.shape)
