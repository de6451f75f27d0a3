"""``on_cuda``: kvpolicy's engine options prepared as on vLLM's CUDA platform, without a GPU."""

from types import SimpleNamespace

import pytest

from kvpolicy.vllm.internals import KV_CACHE_LAYOUT_ENV, MODEL_RUNNER_V2_ENV
from kvpolicy.vllm.startup import args


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(args, "current_platform", SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True))
    for name in (MODEL_RUNNER_V2_ENV, KV_CACHE_LAYOUT_ENV):  # restored after the test: the plugin sets them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch
