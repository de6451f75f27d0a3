"""The worker side of each mode a policy runs in (``policy.mode``): its requests' state and the builder of
its steps (``ModeState``), and the path that runs its steps in every attention layer; ``base.py`` holds
what they share. A mode is its module and its line in ``MODES``."""

from __future__ import annotations

from kvpolicy.policies import Mode
from kvpolicy.vllm.worker.modes.base import HostBatch, ModeState, StepShape
from kvpolicy.vllm.worker.modes.per_head_path import PerHeadPath
from kvpolicy.vllm.worker.modes.relocate import Relocate
from kvpolicy.vllm.worker.modes.select import Select, SelectionPath
from kvpolicy.vllm.worker.modes.share import Share, SharingPath
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.state import WorkerState
from kvpolicy.vllm.worker.step import StepPath

#: mode -> (its worker side, the path that runs its steps); the stock mode has neither.
MODES: dict[Mode, tuple[type[ModeState], type]] = {
    Mode.RELOCATE: (Relocate, PerHeadPath),
    Mode.SELECT: (Select, SelectionPath),
    Mode.SHARE: (Share, SharingPath),
}


def make_mode(worker: WorkerState) -> ModeState | None:
    """The worker side of its policy's mode; None for the stock one, or before the worker has a runner
    (every row takes the platform's path)."""
    if worker.policy is None or worker.runner is None or worker.policy.mode not in MODES:
        return None
    return MODES[worker.policy.mode][0](worker)


def make_path(mode: ModeState, ops: KVOps) -> StepPath:
    """The path that runs ``mode``'s steps over ``ops`` in every layer."""
    return MODES[mode.worker.policy.mode][1](mode, ops)


__all__ = ["MODES", "HostBatch", "ModeState", "Relocate", "Select", "Share", "StepShape", "make_mode", "make_path"]
