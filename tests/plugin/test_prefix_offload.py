"""kvpolicy's offloading spec for vLLM's offloading connector (kvpolicy/vllm/scheduler/prefix_offload.py): stores copied
after their request's relocation complete as failed, and blocks travel to host chunks and back whole."""

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor, ReqContext

from kvpolicy.vllm.internals import CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec, PrepareStoreOutput
from kvpolicy.vllm.scheduler.prefix_offload import HostCopyWorker, StoresBeforeRelocation
from kvpolicy.vllm.scheduler.rewrite_history import RELOCATIONS


class RecordingManager:
    """vLLM's manager's side of the calls: what was prepared and how each store completed."""

    def __init__(self):
        self.completed: list[tuple[tuple, bool]] = []

    def prepare_store(self, keys, req_context):
        return PrepareStoreOutput(keys_to_store=list(keys), store_spec=CPULoadStoreSpec([0]), evicted_keys=[])

    def complete_store(self, keys, req_context, success=True):
        self.completed.append((tuple(keys), success))

    def on_request_finished(self, req_context):
        return None

    def lookup(self, key, req_context):
        return "delegated"


@pytest.fixture
def manager(monkeypatch):
    monkeypatch.setattr(RELOCATIONS, "step", 0)
    monkeypatch.setattr(RELOCATIONS, "first_step", {})
    monkeypatch.setattr(RELOCATIONS, "watched", False)
    inner = RecordingManager()
    return inner, StoresBeforeRelocation(inner)


def test_a_store_asked_for_before_the_relocation_step_completes_and_one_asked_for_in_it_fails(manager):
    inner, wrapped = manager
    request = ReqContext(req_id="r")
    RELOCATIONS.next_step()  # step 1: the store of step 1's blocks runs at the start of step 2
    wrapped.prepare_store(["a"], request)
    RELOCATIONS.next_step()  # step 2: its blocks are copied at the start of step 3, after this step relocates
    wrapped.prepare_store(["b"], request)
    RELOCATIONS.record("r")
    wrapped.complete_store(["a"], request)
    wrapped.complete_store(["b"], request)
    assert inner.completed == [(("a",), True), (("b",), False)]


def test_a_relocated_request_stores_nothing_more_and_is_forgotten_once_finished(manager):
    inner, wrapped = manager
    request = ReqContext(req_id="r")
    RELOCATIONS.next_step()
    RELOCATIONS.record("r")
    RELOCATIONS.next_step()
    assert wrapped.prepare_store(["c"], request).keys_to_store == []
    wrapped.on_request_finished(request)
    assert RELOCATIONS.relocated_in("r") is None
    assert wrapped.lookup("c", request) == "delegated"


def test_a_request_finished_with_a_store_in_flight_is_forgotten_when_the_store_completes(manager):
    inner, wrapped = manager
    request = ReqContext(req_id="r")
    RELOCATIONS.next_step()
    wrapped.prepare_store(["d"], request)
    RELOCATIONS.record("r")
    wrapped.on_request_finished(request)
    assert RELOCATIONS.relocated_in("r") == 1  # the store asked for in step 1 has not completed yet
    wrapped.complete_store(["d"], request)
    assert inner.completed == [(("d",), False)] and RELOCATIONS.relocated_in("r") is None


def test_nothing_is_recorded_without_an_offloading_manager_to_read_it(manager, monkeypatch):
    monkeypatch.setattr(RELOCATIONS, "watched", False)
    RELOCATIONS.record("r")
    assert RELOCATIONS.relocated_in("r") is None


def kv_caches(num_blocks: int, page_bytes: tuple[int, ...]) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """One canonical tensor per page size, as vLLM's offloading worker makes them: int8 (blocks, page bytes)
    views of a cache whose block stride is larger than the page."""
    tensors, views = [], []
    for size in page_bytes:
        backing = torch.randint(-128, 127, (num_blocks, size + 16), dtype=torch.int8)
        views.append(backing[:, :size])
        tensors.append(CanonicalKVCacheTensor(backing[:, :size], size))
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=size) for i, size in enumerate(page_bytes)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs), views


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_blocks_stored_into_chunks_load_back_into_other_blocks_bit_for_bit(blocks_per_chunk):
    caches, views = kv_caches(num_blocks=8, page_bytes=(24, 40))
    worker = HostCopyWorker(caches, blocks_per_chunk, num_chunks=4)
    before = [view.clone() for view in views]
    # Request positions 1..3 (blocks 5, 2, 7): with 2-block chunks, position 1 is the second half of chunk 3.
    stored = GPULoadStoreSpec([5, 2, 7], group_sizes=[3], block_indices=[1])
    chunks = CPULoadStoreSpec([3, 0] if blocks_per_chunk == 2 else [3, 0, 1])
    assert worker.submit_store(1, stored, chunks)
    assert worker.submit_load(2, chunks, GPULoadStoreSpec([0, 1, 4], group_sizes=[3], block_indices=[1]))
    results = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [(1, True, 3 * 64), (2, True, 3 * 64)]
    for view, old in zip(views, before, strict=True):
        assert torch.equal(view[[0, 1, 4]], old[[5, 2, 7]])
        untouched = np.setdiff1d(np.arange(8), [0, 1, 4])
        assert torch.equal(view[untouched], old[untouched])
