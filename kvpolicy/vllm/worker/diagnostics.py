"""What a GPU run can ask a worker to record, through the environment; nothing is recorded by default.

``KVPOLICY_DIAGNOSE=DIR`` records the host synchronisations inside kvpolicy's step building and attention
calls (``torch.cuda.set_sync_debug_mode("warn")``, counted by where they come from, into
``DIR/syncs-<rank>.json`` every ``WRITE_EVERY`` steps), and, after ``SKIP_STEPS`` pure-decode steps, profiles
the next ``PROFILE_STEPS`` into a summary per step (``DIR/profile-<rank>.json``: wall and GPU-busy time, kernels
launched, the host's share, the longest kernels). What each file holds: docs/operations.md#diagnostics-on-a-gpu.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

DIAGNOSE_ENV = "KVPOLICY_DIAGNOSE"
SKIP_STEPS = 64
PROFILE_STEPS = 20
WRITE_EVERY = 50


class Diagnostics:
    """One worker's recorder (``from_env``: None unless ``KVPOLICY_DIAGNOSE`` names a folder)."""

    def __init__(self, folder: Path, rank: int):
        self.folder = folder
        self.rank = rank
        self.syncs: Counter = Counter()
        self.calls = 0
        self.steps = 0
        self.decode_steps = 0
        self._profiler = None
        self._profiled_steps = 0
        self._done = False
        self._on_cuda = torch.cuda.is_available()
        folder.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, rank: int) -> Diagnostics | None:
        folder = os.environ.get(DIAGNOSE_ENV)
        return None if not folder else cls(Path(folder), rank)

    @contextmanager
    def sync_scope(self, what: str):
        """Count the host synchronisations ``what`` (one of kvpolicy's calls) makes."""
        self.calls += 1
        if not self._on_cuda:
            yield
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for warning in caught:
            if "synchroniz" in str(warning.message).lower():
                self.syncs[f"{what}: {Path(warning.filename).name}:{warning.lineno}"] += 1

    @contextmanager
    def step(self, decode_only: bool):
        """One ``execute_model``: profiled when it is one of the decode steps to profile."""
        self.steps += 1
        self.decode_steps += decode_only
        profiling = decode_only and not self._done and self.decode_steps > SKIP_STEPS
        if profiling and self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._on_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        try:
            with torch.profiler.record_function("kvpolicy_step") if profiling else nullcontext():
                yield
        finally:
            if profiling:
                self._profiled_steps += 1
                if self._profiled_steps == PROFILE_STEPS:
                    if self._on_cuda:
                        torch.cuda.synchronize()
                    self._profiler.__exit__(None, None, None)
                    self._write_profile()
                    self._done = True
            if self.steps % WRITE_EVERY == 0:
                self.write_syncs()

    def write_syncs(self) -> None:
        payload = {"calls": self.calls, "steps": self.steps, "syncs": sum(self.syncs.values()), "by_place": self.syncs}
        (self.folder / f"syncs-{self.rank}.json").write_text(json.dumps(payload, indent=1))

    def _write_profile(self) -> None:
        events = self._profiler.events()
        steps = [e for e in events if e.name == "kvpolicy_step"]
        device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "kvpolicy_step"]
        # The window from the first step's start to the last step's or device op's end (the device may run
        # behind the host), and the union of the device's intervals in it.
        first = min(e.time_range.start for e in steps)
        last = max([e.time_range.end for e in steps] + [e.time_range.end for e in device])
        busy = sum(r.end - r.start for r in _union(e.time_range for e in device))
        kernels = Counter()
        for event in device:
            kernels[event.name[:80]] += event.time_range.end - event.time_range.start
        host = [e.time_range.end - e.time_range.start for e in steps]
        # Copies (OmniKV's loads from the host pool) against the kernels: how much of their time the kernels hide.
        copies = [e.time_range for e in device if "memcpy" in e.name.lower()]
        computing = _union(e.time_range for e in device if "memcpy" not in e.name.lower())
        copy_us = sum(c.end - c.start for c in copies)
        hidden_us = sum(max(0, min(c.end, k.end) - max(c.start, k.start)) for c in copies for k in computing)
        summary = {
            "steps": len(steps),
            "window_us": last - first,
            "mean_step_us": (last - first) / len(steps),
            "mean_host_us": sum(host) / len(host),
            "device_busy_fraction": busy / (last - first) if device else None,
            "device_idle_us_per_step": (last - first - busy) / len(steps) if device else None,
            "device_ops_per_step": len(device) / len(steps),
            "copy_us_per_step": copy_us / len(steps),
            "copy_hidden_fraction": hidden_us / copy_us if copy_us else None,
            "top_device_ops_us": kernels.most_common(25),
        }
        (self.folder / f"profile-{self.rank}.json").write_text(json.dumps(summary, indent=1))


def sync_scope(diagnostics: Diagnostics | None, what: str):
    """``diagnostics.sync_scope(what)``, or nothing to record when no diagnostics are asked for."""
    return nullcontext() if diagnostics is None else diagnostics.sync_scope(what)


def _union(ranges) -> list:
    """Intervals (``start``, ``end``) merged where they overlap, in order."""
    merged = []
    for r in sorted(ranges, key=lambda r: r.start):
        if merged and r.start <= merged[-1].end:
            merged[-1] = _Range(merged[-1].start, max(merged[-1].end, r.end))
        else:
            merged.append(_Range(r.start, r.end))
    return merged


@dataclass(frozen=True)
class _Range:
    start: int
    end: int
