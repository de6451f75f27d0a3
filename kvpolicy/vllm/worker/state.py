"""What one worker process knows, whatever mode its policy runs in.

The worker hook (``hook.py``) makes one ``WorkerState`` per worker and its policy's mode over it
(``modes.make_mode``), then hands both out explicitly: the metadata builders build each step with the
mode and attach the mode's path to it, which every attention layer runs; kvpolicy's connector reads the
step's block releases and the counters here. No module holds it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpolicy.config import KVPolicyConfig
from kvpolicy.paging import write_order
from kvpolicy.policies import HeadGroup, Policy
from kvpolicy.vllm.internals import extract_layer_index
from kvpolicy.vllm.messages import BlockRelease, BlockReleases


@dataclass(frozen=True)
class PageSpace:
    """vLLM's whole KV buffer (every layer) as one-head pages, [pages, 1, block_size, 2*head_size];
    layer ``l``'s block ``b``, head ``h`` is page ``layer_base[l] + b*H + h``.

    vLLM allocates every layer in one buffer; this needs its LBHNC layout, where each layer's cache
    is a contiguous slice (the CPU platform's; on CUDA ``args`` asks vLLM for it)."""

    pages: torch.Tensor
    layer_base: list[int]

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> PageSpace:
        first = kv_caches[0]
        num_blocks, heads, block_size, width = first.shape
        page_elems = block_size * width
        storage = first.untyped_storage()
        num_pages = storage.nbytes() // first.element_size() // page_elems
        pages = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            storage, 0, (num_pages, 1, block_size, width)
        )
        bases = []
        for cache in kv_caches:
            if cache.untyped_storage().data_ptr() != storage.data_ptr() or not cache.is_contiguous():
                raise RuntimeError(
                    "kvpolicy's page space (--kv-offload, pod, --kv-page-pool model) needs every layer's KV cache "
                    "to be a contiguous [blocks, heads, block_size, 2*head_size] slice of one buffer (vLLM's LBHNC "
                    f"layout); these are not (strides {tuple(cache.stride())})"
                )
            if cache.storage_offset() % page_elems:
                raise RuntimeError("a layer's KV cache does not start at a page boundary of the shared buffer")
            bases.append(cache.storage_offset() // page_elems)
        return cls(pages, bases)


@dataclass
class WorkerState:
    """Per worker process: the configuration and policy, the model runner (to map batch rows to
    request ids), tensor and pipeline parallelism, the page space over vLLM's KV buffer, the scheduler's
    word on shared blocks, the step's block releases, counters for the metrics, and the active mode
    (any object with ``forget`` and ``held_pages``: ``modes.ModeState``)."""

    config: KVPolicyConfig | None = None
    policy: Policy | None = None
    runner: Any = None
    #: The active mode's worker side and its requests; None while every row takes the stock path.
    mode: Any = None
    #: This step's prompts with blocks other requests read or in the prefix cache: req id -> (shared, cached)
    #: block-table positions (``KVPolicyConnectorMetadata``).
    block_sharing: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    #: This step's requests whose pages changed, for the connector (``BlockRelease``).
    releases: dict[str, BlockRelease] = field(default_factory=dict)
    family: dict[str, Policy] = field(default_factory=dict)  # other policies of the family, by name
    ops: str | None = None  # the builders' KVOps class, for logs and tests
    #: Decode batches run in fixed shapes (``modes/fixed_decode.py``) for the platform's full CUDA graphs;
    #: then ``prompt_in_step`` (set per step from the scheduler's output) keeps a step with prompt rows
    #: out of them.
    fixed_decode: bool = False
    prompt_in_step: bool = False
    tp_rank: int = 0
    #: This rank's share of every layer's KV heads for layer-wide choices, under --kv-tp-allocation exact.
    head_group: HeadGroup | None = None
    #: The pipeline stage: its rank, and the model's index of its first layer. A stage holds, writes and
    #: compresses only its own layers, counted from there; requests are counted by the first stage only.
    pipeline_rank: int = 0
    first_layer: int = 0
    _page_space: PageSpace | None = None
    _layer_indices: dict[str, int] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)
    #: ``KVPOLICY_DIAGNOSE``'s recorder (``diagnostics.py``), None unless asked for.
    diagnostics: Any = None
    #: Counts made where the cache is, added up there and read at the report, not in the step.
    device_counts: dict[str, torch.Tensor] = field(default_factory=dict)
    _reported_memory: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls, config: KVPolicyConfig | None, runner: Any, tensor_parallel=None, stage: tuple[int, int] = (0, 0)
    ) -> WorkerState:
        """``tensor_parallel``: ``(rank, size, gather)`` of the worker's tensor-parallel group, if any;
        ``stage``: ``(rank, first layer)`` of its pipeline stage."""
        rank, size, gather = tensor_parallel or (0, 1, None)
        exact = size > 1 and config is not None and config.tp_allocation == "exact"
        return cls(
            config=config,
            policy=config.make_policy() if config is not None else None,
            runner=runner,
            tp_rank=rank,
            head_group=HeadGroup(rank, size, gather) if exact else None,
            pipeline_rank=stage[0],
            first_layer=stage[1],
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one vLLM block: its pages in every layer."""
        return sum(cache[0].nbytes for cache in self.runner.kv_caches)

    def page_space(self) -> PageSpace:
        if self._page_space is None:
            self._page_space = PageSpace.of(self.runner.kv_caches)
        return self._page_space

    def layer_index(self, layer_name: str) -> int:
        """The index of an attention layer within this worker's stage, parsed once per name: every layer
        asks at every step."""
        index = self._layer_indices.get(layer_name)
        if index is None:
            index = self._layer_indices[layer_name] = extract_layer_index(layer_name) - self.first_layer
        return index

    def policy_named(self, name: str | None) -> Policy:
        """A request's policy: the server's, or another of its family (``kv_policy``, already validated)."""
        if name is None or name == self.policy.name:
            return self.policy
        if name not in self.family:
            self.family[name] = self.config.for_policy(name).make_policy()
        return self.family[name]

    def writable_blocks(self, req_id: str, num_blocks: int) -> tuple[list[int], bool]:
        """The block-table positions a request may write this step, in the order to fill them
        (``write_order`` over ``block_sharing``), and whether other requests read some of its blocks."""
        shared, cached = self.block_sharing.get(req_id, ((), ()))
        return write_order(num_blocks, shared, cached), bool(shared)

    def forget(self, req_ids) -> None:
        """Finished or preempted requests: the active mode drops their state."""
        if self.mode is not None:
            for req_id in req_ids or ():
                self.mode.forget(req_id)

    def take_releases(self) -> BlockReleases | None:
        """After the step's forward, every layer has moved: the blocks each changed request keeps, for the
        scheduler, with the counters of what was released and relocated."""
        keep_blocks, seen = {}, {}
        counters = self.counters
        for req_id, release in self.releases.items():
            pages = release.pages
            keep = keep_blocks[req_id] = (
                release.keep if release.keep is not None else pages.blocks_to_keep(release.length)
            )
            seen[req_id] = len(pages.blocks)
            counters["peak_request_kv_blocks"] = max(counters["peak_request_kv_blocks"], pages.live_blocks())
            released = pages.release_except(keep)
            counters["released_blocks"] += released
            counters["released_bytes"] += released * self.block_bytes
            if release.keep is not None:
                continue  # an offload: its sparse layers went to the host pool
            if not release.prompt_done:
                counters["eviction_passes"] += 1
                continue
            counters["relocated_requests"] += 1
            counters["kept_kv_tokens"] += pages.kept_tokens()
            prompt_len = self.runner.requests[req_id].num_prompt_tokens
            prompt_tokens = prompt_len * pages.num_layers * pages.num_heads
            counters["prompt_kv_tokens"] += prompt_tokens
            counters["compressed_requests"] += pages.kept_tokens() < prompt_tokens
            counters["held_kv_pages"] += len(keep) * pages.num_layers * pages.num_heads
            counters["ideal_kv_pages"] += pages.kept_tokens() / pages.block_size
        self.releases.clear()
        return BlockReleases(keep_blocks, seen) if keep_blocks else None

    def memory_now(self) -> dict[str, int]:
        """The memory compression saves right now (``metrics.GAUGES``): requests holding fewer blocks
        than their tokens in the cache would fill uncompressed, their blocks and bytes."""
        requests = blocks = full_blocks = 0
        for req_id, pages in self.mode.held_pages() if self.mode is not None else ():
            state = self.runner.requests.get(req_id)
            held = pages.live_blocks()
            full = 0 if state is None else -(-state.num_computed_tokens // pages.block_size)
            if held < full:
                requests += 1
                blocks += held
                full_blocks += full
        block_bytes = self.block_bytes if requests else 0
        return {
            "requests_compressed_now": requests,
            "compressed_kv_blocks": blocks,
            "compressed_kv_bytes": blocks * block_bytes,
            "uncompressed_kv_bytes": full_blocks * block_bytes,
            "saved_kv_bytes": (full_blocks - blocks) * block_bytes,
        }

    def count_on_device(self, key: str, count: torch.Tensor) -> None:
        """Add a count the step made on the device, without reading it back in the step."""
        total = self.device_counts.get(key)
        self.device_counts[key] = count if total is None else total + count

    def take_report(self) -> dict[str, int]:
        """Counter increments since the last report (device counts read here, after the step), and the
        memory snapshot when it changed."""
        for key, total in self.device_counts.items():
            self.counters[key] += int(total)
        self.device_counts.clear()
        report = {key: value for key, value in self.counters.items() if value}
        self.counters.clear()
        memory = self.memory_now()
        if memory != self._reported_memory:
            report.update(memory)
            self._reported_memory = memory
        return report
