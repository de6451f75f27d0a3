"""The GPU window's plan and what its results must hold, checked without a GPU."""

import json

import pytest

from benchmarks.gpu.throughput_sweep import ORDER, PRESETS, WINDOW, WINDOW_FIELDS, bench_args, check, watched_fields
from benchmarks.gpu_kernels import peak_gbps


@pytest.mark.parametrize(
    ("device", "peak"),
    [("NVIDIA H200", 4800), ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 NVL", 3900), ("NVIDIA H100 PCIe", 2000)],
)
def test_bandwidth_is_the_devices_own_peak(device, peak):
    assert peak_gbps(device) == peak
    assert peak_gbps("NVIDIA A10G") is None, "no percentage rather than another device's"


def test_the_window_runs_the_decisive_rows_first():
    assert WINDOW[:4] == [
        ("adasnap", "tight"),
        ("vllm-default", "tight"),
        ("adasnap", "batch8"),
        ("vllm-default", "batch8"),
    ]
    assert ORDER[: len(WINDOW)] == WINDOW
    batch8 = PRESETS["gpu"]["pools"]["batch8"]
    assert batch8["prompts"] == batch8["fits"], "one wave of 8: plain vLLM and adasnap both run all 8 at once"


def test_every_row_runs_one_engine_configuration_whatever_its_pool(tmp_path):
    """vLLM's compile cache is keyed by the engine's configuration: a pool must not change it."""
    preset = PRESETS["gpu"]
    config = {"args": ["--kv-policy", "adasnap", "--kv-budget", "{budget}"]}
    tight, batch8 = (
        bench_args(preset, config, pool, tmp_path, tmp_path / "o.json", True) for pool in ("tight", "batch8")
    )
    assert tight.count("--max-num-seqs") == batch8.count("--max-num-seqs") == 1
    assert "--cudagraph-capture-sizes" in tight and "--async-scheduling" in tight


def probe(**overrides) -> dict:
    return {
        "engine": {"async_scheduling": True},
        "graph_steps": {"FULL": 900, "PIECEWISE": 40},
        "triton_compiles": {},
        "host_syncs": {"gpu_model_runner.py:1": 3},
        "fixed_decode_steps": {8: 880, 16: 20},
        "watched_on": ["cuda"],
        **overrides,
    }


def test_a_rows_watched_facts():
    fields = watched_fields(probe())
    assert fields["full_graph_steps"] == 900 and fields["piecewise_steps"] == 40 and fields["eager_steps"] == 0
    assert fields["fixed_steps"] == 900 and fields["triton_compiles"] == 0 and fields["host_syncs"] == 3
    plain = watched_fields(probe(fixed_decode_steps=None, host_syncs="none: no device"))
    assert isinstance(plain["fixed_steps"], str) and plain["host_syncs"] == "none: no device"


def test_check_fails_a_row_that_did_not_finish_or_misses_a_field(tmp_path):
    full = {key: 1 for key in WINDOW_FIELDS}
    good = {"runs": [{"config": "adasnap", "pool": "tight", "status": "ok", **full}]}
    path = tmp_path / "window.json"
    path.write_text(json.dumps(good))
    assert check([path]) == 0
    good["runs"].append({"config": "vllm-default", "pool": "tight", "status": "ok", **full, "stall_s": None})
    path.write_text(json.dumps(good))
    assert check([path]) == 1
    engines = tmp_path / "pod.json"
    engines.write_text(json.dumps({"configs": {"pod": {"rc": 1}}}))
    assert check([engines]) == 1
    assert check([tmp_path / "missing.json"]) == 1
