"""The worker side of each mode a policy runs in (``policy.mode``): its requests' state, the builder of
its steps and its attention path, one module each; ``base.py`` holds what they share."""

from __future__ import annotations

from kvpolicy.policies import Mode
from kvpolicy.vllm.modes.base import HostBatch, ModeState, StepShape
from kvpolicy.vllm.modes.relocate import Relocate
from kvpolicy.vllm.modes.select import Select
from kvpolicy.vllm.modes.share import Share
from kvpolicy.vllm.state import WorkerState

MODES: dict[Mode, type[ModeState]] = {Mode.RELOCATE: Relocate, Mode.SELECT: Select, Mode.SHARE: Share}


def mode_state(mode: Mode, worker: WorkerState) -> ModeState | None:
    """The worker side of ``mode``; None for the stock one (every row takes the platform's path)."""
    cls = MODES.get(mode)
    return None if cls is None else cls(worker)


__all__ = ["MODES", "HostBatch", "ModeState", "Relocate", "Select", "Share", "StepShape", "mode_state"]
