"""KVPOLICY_DIAGNOSE's recorder on this CPU: nothing is recorded unless asked for; asked for, the sync counts and
a profile of the decode steps after the skipped ones are written (the device's numbers only a GPU fills)."""

import json

import torch

from kvpolicy.vllm.worker.diagnostics import (
    DIAGNOSE_ENV,
    PROFILE_STEPS,
    SKIP_STEPS,
    WRITE_EVERY,
    Diagnostics,
    sync_scope,
)


def test_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv(DIAGNOSE_ENV, raising=False)
    assert Diagnostics.from_env(0) is None
    with sync_scope(None, "attend"):
        pass


def test_asked_for_it_counts_calls_and_profiles_the_decode_steps_after_the_skipped_ones(monkeypatch, tmp_path):
    monkeypatch.setenv(DIAGNOSE_ENV, str(tmp_path))
    diagnostics = Diagnostics.from_env(3)
    for step in range(SKIP_STEPS + PROFILE_STEPS + WRITE_EVERY):
        with diagnostics.step(decode_only=step % 10 != 0):
            with sync_scope(diagnostics, "attend"):
                torch.ones(4).sum()
    syncs = json.loads((tmp_path / "syncs-3.json").read_text())
    assert syncs["syncs"] == 0 and syncs["calls"] == syncs["steps"] > 0
    profile = json.loads((tmp_path / "profile-3.json").read_text())
    assert profile["steps"] == PROFILE_STEPS and profile["mean_step_us"] > 0
    assert profile["device_busy_fraction"] is None  # no device here
