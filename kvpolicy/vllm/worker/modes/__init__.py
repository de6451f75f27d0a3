"""Each mode a policy runs in (``policy.mode``), as both processes know it: its rules (which blocks a step
rewrites, ``ModeState.written_blocks``; when decode compresses, ``ModeState.decode_passes``; asked by the
scheduler and the worker alike), its requests' state and the builder of its steps (``ModeState``), and the
path that runs its steps in every attention layer; ``base.py`` holds what they share. A mode is its module
and its line in ``MODES``."""

from __future__ import annotations

from typing import NamedTuple

from kvpolicy.policies import Mode
from kvpolicy.vllm.worker.modes.base import HostBatch, ModeState, RequestStep, StepShape
from kvpolicy.vllm.worker.modes.per_head_path import PerHeadPath
from kvpolicy.vllm.worker.modes.relocate import Relocate
from kvpolicy.vllm.worker.modes.select import Select, SelectionPath
from kvpolicy.vllm.worker.modes.share import Share, SharingPath
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.state import WorkerState
from kvpolicy.vllm.worker.step import StepPath


class ModeKind(NamedTuple):
    """One mode: its rule, requests and step builder (``state``) and the path that runs its steps."""

    state: type[ModeState]
    path: type[StepPath]


#: mode -> its kind; the stock mode has none.
MODES: dict[Mode, ModeKind] = {
    Mode.RELOCATE: ModeKind(Relocate, PerHeadPath),
    Mode.SELECT: ModeKind(Select, SelectionPath),
    Mode.SHARE: ModeKind(Share, SharingPath),
}


def make_mode(worker: WorkerState) -> ModeState | None:
    """The worker side of its policy's mode; None for the stock one, or before the worker has a runner
    (every row takes the platform's path)."""
    if worker.policy is None or worker.runner is None or worker.policy.mode not in MODES:
        return None
    return MODES[worker.policy.mode].state(worker)


def make_path(mode: ModeState, ops: KVOps) -> StepPath:
    """The path that runs ``mode``'s steps over ``ops`` in every layer."""
    return MODES[mode.worker.policy.mode].path(mode, ops)


__all__ = [
    "MODES",
    "HostBatch",
    "ModeKind",
    "ModeState",
    "Relocate",
    "RequestStep",
    "Select",
    "Share",
    "StepShape",
    "make_mode",
    "make_path",
]
