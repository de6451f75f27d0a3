"""The memory snapshot behind kvpolicy's gauges, and how reports combine across ranks."""

from types import SimpleNamespace

import torch

from kvpolicy.paging import RequestPages
from kvpolicy.vllm.metrics import COUNTERS, GAUGES, PEAKS, KVPolicyStats
from kvpolicy.vllm.worker.modes import Relocate
from kvpolicy.vllm.worker.state import WorkerState

BLOCK_SIZE, LAYERS = 16, 2


def worker_with(computed_tokens: dict[str, int], kept_blocks: dict[str, int]) -> WorkerState:
    """A worker whose relocated requests hold ``kept_blocks`` of the blocks their tokens filled."""
    state = WorkerState()
    cache = torch.zeros(8, 1, BLOCK_SIZE, 4)  # one block of one layer: 16 tokens x 4 floats = 256 bytes
    state.runner = SimpleNamespace(
        kv_caches=[cache] * LAYERS,
        requests={req: SimpleNamespace(num_computed_tokens=n) for req, n in computed_tokens.items()},
    )
    state.mode = Relocate(state)
    for req, n in computed_tokens.items():
        pages = RequestPages(LAYERS, 1, BLOCK_SIZE, list(range(-(-n // BLOCK_SIZE))))
        pages.release_except(set(range(kept_blocks[req])))
        state.mode.track(req).pages = pages
    return state


def test_the_snapshot_counts_requests_holding_less_than_their_tokens_fill():
    state = worker_with({"a": 64, "b": 40, "whole": 33}, {"a": 1, "b": 2, "whole": 3})
    block_bytes = LAYERS * BLOCK_SIZE * 4 * 4
    assert state.memory_now() == {
        "requests_compressed_now": 2,
        "compressed_kv_blocks": 3,
        "compressed_kv_bytes": 3 * block_bytes,
        "uncompressed_kv_bytes": (4 + 3) * block_bytes,
        "saved_kv_bytes": 4 * block_bytes,
    }
    assert set(state.memory_now()) == set(GAUGES)


def test_a_snapshot_is_reported_when_it_changes_and_once_more_when_it_empties():
    state = worker_with({"a": 64}, {"a": 1})
    state.counters["released_blocks"] += 3
    first = state.take_report()
    assert first["released_blocks"] == 3 and first["saved_kv_bytes"] > 0
    assert state.take_report() == {}
    state.forget(["a"])
    assert state.take_report() == dict.fromkeys(GAUGES, 0)
    assert state.take_report() == {}


def test_ranks_combine_counters_by_sum_peaks_by_max_blocks_by_max_and_bytes_by_sum():
    rank = {"released_blocks": 2, "peak_request_kv_blocks": 5, "compressed_kv_blocks": 3, "saved_kv_bytes": 100}
    other = {"released_blocks": 2, "peak_request_kv_blocks": 7, "compressed_kv_blocks": 3, "saved_kv_bytes": 100}
    combined = KVPolicyStats(data=dict(rank)).aggregate(KVPolicyStats(data=other)).reduce()
    assert combined == {
        "released_blocks": 4,
        "peak_request_kv_blocks": 7,
        "compressed_kv_blocks": 3,
        "saved_kv_bytes": 200,
    }


def test_metric_names_follow_prometheus_conventions():
    names = [name for name, *_ in (*COUNTERS.values(), *PEAKS.values(), *GAUGES.values())]
    assert len(set(names)) == len(names)
    assert all(name.startswith("vllm:kvpolicy_") and not name.endswith("_total") for name in names)
    assert all(name.endswith("_bytes") for key, (name, *_) in GAUGES.items() if key.endswith("_bytes"))
