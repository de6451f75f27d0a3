"""Tensor parallelism through vLLM: two ranks, each compressing its own KV heads.

The default model's 3 KV heads do not split in two, so this runs a small
random-weight Llama made locally with 4 KV heads (``prepare_tiny``), one
rank per core. With ``--kv-tp-allocation exact`` (the default) Ada-KV's
layer-wide allocation gathers every rank's scores, so two ranks keep what one
keeps: the same tokens, the same counts, counted once in the metrics.
"""

import os

import pytest

from kvpolicy.offline.model import prepare_tiny
from tests.e2e.test_ops_in_engine import assert_same_tokens, assert_the_policy_acted

RUN = ("--budget", "64", "--max-tokens", "12")
#: ``make test-avx2`` (tests/avx2/sitecustomize.py) forces AVX2 code on an AVX-512 machine. vLLM's own two-rank
#: engine fails there with no plugin loaded too (``--stock``, ``ATEN_CPU_CAPABILITY=avx2`` alone: IndexError in
#: the vocabulary-parallel embedding, 2026-11-28), so that emulation cannot run this test.
AVX2_EMULATED = os.environ.get("KVPOLICY_EMULATE_AVX2") == "1"


@pytest.fixture(scope="module")
def four_kv_heads():
    return prepare_tiny(num_layers=4, num_heads=8, num_kv_heads=4, head_size=64)


@pytest.mark.xfail(AVX2_EMULATED, reason="vLLM's two ranks fail under forced AVX2 dispatch", strict=True)
def test_two_ranks_compress_like_one(engine_run, four_kv_heads):
    one = engine_run("--policy", "adasnap", *RUN, model=four_kv_heads)
    two = engine_run("--policy", "adasnap", *RUN, "--tensor-parallel", "2", model=four_kv_heads)
    assert_the_policy_acted("adasnap", one["counters"])
    for key in ("relocated_requests", "compressed_requests", "released_blocks", "kept_kv_tokens", "prompt_kv_tokens"):
        assert two["counters"][key] == one["counters"][key], key
    assert_same_tokens(one, two)
    assert two["kv_cache_usage_end"] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tensor-parallel", "8"), "does not split the 4 KV heads"),
    ],
)
def test_shapes_that_do_not_split_are_refused(engine_run, four_kv_heads, args, message):
    assert message in engine_run("--policy", "adasnap", *RUN, *args, fails=True, model=four_kv_heads)
