"""vLLM's offloading connector beside kvpolicy: a second tier for prefix-cache blocks.

vLLM's ``OffloadingConnector`` copies a request's full blocks, by their token hashes, to host memory at the start
of the next step and loads them back for a later prompt with the same prefix; kvpolicy names its own offloading
spec in place of ``CPUOffloadingSpec`` so that a block kvpolicy rewrote is never stored under its hashes
(``StoresBeforeRelocation`` fails such a store and stores nothing more of the request), and so that vLLM's CPU
platform, which has no offloading worker, gets one (``HostCopyWorker``: a second host buffer). The manager's
chunks and LRU eviction stay vLLM's. Details: docs/architecture.md#beside-other-kv-connectors.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import numpy as np
import torch

from kvpolicy.vllm.internals import (
    CanonicalKVCaches,
    CPULoadStoreSpec,
    CPUOffloadingSpec,
    GPULoadStoreSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    TransferResult,
    current_platform,
)
from kvpolicy.vllm.scheduler.rewrite_history import RELOCATIONS

#: what ``compose`` writes into the connector's ``kv_connector_extra_config``
SPEC_NAME = "KVPolicyOffloadingSpec"
SPEC_MODULE = "kvpolicy.vllm.scheduler.prefix_offload"


class StoresBeforeRelocation:
    """vLLM's offloading manager, keeping only stores copied while their blocks held their tokens.

    Each store is stamped with the step whose metadata asked for it (its copy runs at the start of
    the next); one stamped at or after the step its request was first relocated in completes as
    failed. Every other call goes to vLLM's manager unchanged.
    """

    def __init__(self, manager):
        self._manager = manager
        self._stamps: dict[str, dict] = {}  # request -> {offload key: step it was asked for in}
        self._finished: set[str] = set()
        RELOCATIONS.watch()

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def prepare_store(self, keys: Collection, req_context) -> PrepareStoreOutput | None:
        req_id = req_context.req_id
        if RELOCATIONS.relocated_in(req_id) is not None:
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[])
        output = self._manager.prepare_store(keys, req_context)
        if output is not None and output.keys_to_store:
            self._stamps.setdefault(req_id, {}).update(dict.fromkeys(output.keys_to_store, RELOCATIONS.step))
        return output

    def complete_store(self, keys: Collection, req_context, success: bool = True) -> None:
        req_id = req_context.req_id
        stamps = self._stamps.get(req_id, {})
        asked_in = max((stamps.pop(key) for key in keys if key in stamps), default=-1)
        relocated_in = RELOCATIONS.relocated_in(req_id)
        copied_after = relocated_in is not None and asked_in >= relocated_in
        self._manager.complete_store(keys, req_context, success and not copied_after)
        self._settle(req_id)

    def on_request_finished(self, req_context) -> None:
        """Called once every store of the request is asked for; some may still be copying."""
        self._manager.on_request_finished(req_context)
        self._finished.add(req_context.req_id)
        self._settle(req_context.req_id)

    def reset_cache(self) -> None:
        """vLLM drops every chunk and ignores stores asked for before: none will complete."""
        self._manager.reset_cache()
        self._stamps.clear()
        for req_id in list(self._finished):
            self._settle(req_id)

    def _settle(self, req_id: str) -> None:
        if req_id in self._finished and not self._stamps.get(req_id):
            self._stamps.pop(req_id, None)
            self._finished.discard(req_id)
            RELOCATIONS.forget(req_id)


class HostCopyWorker(OffloadingWorker):
    """Copies whole blocks between vLLM's KV cache and host chunks, synchronously: on vLLM's CPU
    platform both are host memory, and a copy done when submitted is done before the step's
    forward writes the blocks again.

    vLLM's block-and-chunk arithmetic (``GPULoadStoreSpec``): per KV-cache group, ``group_sizes[g]``
    blocks, the first at position ``block_indices[g]`` of the request, fill ``blocks_per_chunk``-block
    chunks from that position's offset within its chunk on.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self._blocks_per_chunk = blocks_per_chunk
        self._blocks = [entry.tensor for entry in kv_caches.tensors]
        self._chunks = [
            torch.empty(num_chunks * blocks_per_chunk, blocks.shape[1], dtype=torch.int8) for blocks in self._blocks
        ]
        self._tensors_of_group = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return None

    def _copy(self, job_id: int, blocks: GPULoadStoreSpec, chunks: CPULoadStoreSpec, to_host: bool) -> bool:
        start, num_bytes = time.perf_counter(), 0
        block_offset = chunk_offset = 0
        for group, (count, first) in enumerate(zip(blocks.group_sizes, blocks.block_indices, strict=True)):
            if count == 0:
                continue
            skip = first % self._blocks_per_chunk
            num_chunks = -(-(count + skip) // self._blocks_per_chunk)
            block_ids = torch.from_numpy(blocks.block_ids[block_offset : block_offset + count].astype(np.int64))
            chunk_ids = chunks.block_ids[chunk_offset : chunk_offset + num_chunks].astype(np.int64)
            rows = (chunk_ids[:, None] * self._blocks_per_chunk + np.arange(self._blocks_per_chunk)).ravel()
            rows = torch.from_numpy(rows[skip : skip + count])
            for index in self._tensors_of_group[group]:
                source, target = self._blocks[index], self._chunks[index]
                if to_host:
                    target.index_copy_(0, rows, source.index_select(0, block_ids))
                else:
                    source.index_copy_(0, block_ids, target.index_select(0, rows))
                num_bytes += count * source.shape[1]
            block_offset += count
            chunk_offset += num_chunks
        self._finished.append(TransferResult(job_id, True, num_bytes, time.perf_counter() - start))
        return True


class KVPolicyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading (its chunk sizing from ``cpu_bytes_to_use`` and its manager), with stores
    kept to blocks that held their tokens, and a worker on vLLM's CPU platform too."""

    def get_manager(self):
        if not isinstance(self._manager, StoresBeforeRelocation):
            self._manager = StoresBeforeRelocation(super().get_manager())
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not current_platform.is_cpu():
            return super().get_worker(kv_caches)
        if self.config.canonical_layout:
            raise ValueError(
                "kvpolicy's offloading worker on the CPU platform copies whole blocks; drop canonical_layout "
                "from kv_connector_extra_config"
            )
        if self._worker is None:
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
