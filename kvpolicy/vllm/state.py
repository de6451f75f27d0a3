"""What one worker process knows about kvpolicy requests, shared by its backend, worker hook and connector."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpolicy.config import KVPolicyConfig
from kvpolicy.paging import HostPagePool, OffloadedRequest, RequestPages, SharedPages, write_order
from kvpolicy.policies import HeadGroup, Mode, Policy


@dataclass
class CarriedState:
    """What a policy that evicts in decode carries per layer between a request's compressions."""

    budgets: list[int]
    scores: list[torch.Tensor | None]
    thresholds: list[torch.Tensor | None]

    @classmethod
    def empty(cls, num_layers: int) -> CarriedState:
        return cls([0] * num_layers, [None] * num_layers, [None] * num_layers)


@dataclass(frozen=True)
class PageSpace:
    """vLLM's whole KV buffer (every layer) as one-head pages, [pages, 1, block_size, 2*head_size];
    layer ``l``'s block ``b``, head ``h`` is page ``layer_base[l] + b*H + h``."""

    pages: torch.Tensor
    layer_base: list[int]

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> PageSpace:
        first = kv_caches[0]
        num_blocks, heads, block_size, width = first.shape
        page_elems = block_size * width
        storage = first.untyped_storage()
        num_pages = storage.nbytes() // first.element_size() // page_elems
        pages = torch.empty(0, dtype=first.dtype).set_(storage, 0, (num_pages, 1, block_size, width))
        bases = []
        for cache in kv_caches:
            if cache.untyped_storage().data_ptr() != storage.data_ptr() or not cache.is_contiguous():
                raise RuntimeError(
                    "kvpolicy's page space (--kv-offload, pod, --kv-page-pool model) needs every layer's KV cache "
                    "in one contiguous buffer; this vLLM build allocates them otherwise: use --kv-page-pool layer"
                )
            if cache.storage_offset() % page_elems:
                raise RuntimeError("a layer's KV cache does not start at a page boundary of the shared buffer")
            bases.append(cache.storage_offset() // page_elems)
        return cls(pages, bases)


@dataclass
class WorkerState:
    """Per worker process: the policy, the model runner (to map batch rows to
    request ids), the page tables of relocated requests, the observation-window
    queries and running attention column sums of prompts still being read,
    what each layer observed of a prompt for policies that budget across
    layers, what policies that evict in decode carry, OmniKV's offloaded
    requests and host pool, and counters for the metrics."""

    config: KVPolicyConfig | None = None
    policy: Policy | None = None
    runner: Any = None
    requests: dict[str, RequestPages | SharedPages] = field(default_factory=dict)
    window_queries: dict[str, dict[int, list[torch.Tensor]]] = field(default_factory=dict)
    column_sums: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    observed: dict[str, dict[int, tuple[torch.Tensor, Any]]] = field(default_factory=dict)
    carried: dict[str, CarriedState] = field(default_factory=dict)
    #: req id -> (its prompt completed, its length after the step when its prompt is read whole, else None)
    relocated_this_step: dict[str, tuple[bool, int | None]] = field(default_factory=dict)
    #: This step's prompts with blocks other requests read or in the prefix cache: req id -> (shared, cached)
    #: block-table positions (``KVPolicyConnectorMetadata``).
    block_sharing: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    #: Prompts left on the stock path: their own blocks could not hold what the policy keeps.
    uncompressed: set[str] = field(default_factory=set)
    offloaded: dict[str, OffloadedRequest] = field(default_factory=dict)
    offloaded_this_step: dict[str, set[int]] = field(default_factory=dict)  # req id -> block-table positions it keeps
    host: HostPagePool | None = None
    family: dict[str, Policy] = field(default_factory=dict)  # other policies of the family, by name
    ops: str | None = None  # the backend's KVOps class, for logs and tests
    tp_rank: int = 0
    #: This rank's share of every layer's KV heads for layer-wide choices, under --kv-tp-allocation exact.
    head_group: HeadGroup | None = None
    _page_space: PageSpace | None = None
    counters: Counter = field(default_factory=Counter)
    _reported_memory: dict[str, int] = field(default_factory=dict)

    def configure(self, config: KVPolicyConfig | None, runner: Any, tensor_parallel=None) -> None:
        """``tensor_parallel``: ``(rank, size, gather)`` of the worker's tensor-parallel group, if any."""
        self.config = config
        rank, size, gather = tensor_parallel or (0, 1, None)
        self.tp_rank = rank
        exact = size > 1 and config is not None and config.tp_allocation == "exact"
        self.head_group = HeadGroup(rank, size, gather) if exact else None
        self.policy = config.make_policy() if config is not None else None
        self.family.clear()
        self.runner = runner
        self.requests.clear()
        self.window_queries.clear()
        self.column_sums.clear()
        self.observed.clear()
        self.carried.clear()
        self.offloaded.clear()
        self.host = None
        self._page_space = None

    @property
    def mode(self) -> Mode:
        """The mode this worker runs its policy in; STOCK until the runner is known."""
        return Mode.STOCK if self.policy is None or self.runner is None else self.policy.mode

    @property
    def offloads(self) -> bool:
        return self.mode is Mode.SELECT and self.config.offload is not None

    @property
    def block_bytes(self) -> int:
        """Bytes of one vLLM block: its pages in every layer."""
        return sum(cache[0].nbytes for cache in self.runner.kv_caches)

    @property
    def pools_layers(self) -> bool:
        """Whether a relocated request's layers share one pool of pages: vLLM's whole KV buffer as one
        page space, the CPU layout (``--kv-page-pool``)."""
        return self.config.page_pool != "layer" and self.runner.kv_caches[0].device.type == "cpu"

    def relocated_cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache relocated requests' page ids index: the whole buffer when their layers share a pool."""
        return self.page_space().pages if self.pools_layers else kv_cache

    def page_space(self) -> PageSpace:
        if self._page_space is None:
            self._page_space = PageSpace.of(self.runner.kv_caches)
        return self._page_space

    def host_pool(self) -> HostPagePool:
        """The host tier, ``--kv-offload`` GiB of one-head pages, made at first use."""
        if self.host is None:
            pages = self.page_space().pages
            page_bytes = pages[0].nbytes
            self.host = HostPagePool(
                int(self.config.offload * 2**30) // page_bytes,
                pages[0].numel(),
                pages.dtype,
                pin=torch.cuda.is_available(),
            )
        return self.host

    def policy_named(self, name: str | None) -> Policy:
        """A request's policy: the server's, or another of its family (``kv_policy``, already validated)."""
        if name is None or name == self.policy.name:
            return self.policy
        if name not in self.family:
            self.family[name] = dataclasses.replace(self.config, policy=name).make_policy()
        return self.family[name]

    def stash_window(self, req_id: str, layer: int, queries: torch.Tensor) -> None:
        """Keep a chunk's window queries [tokens, q_heads, head_dim] (a copy: the step's query buffer is
        reused) where they are, on the cache's device: the policy scores them there."""
        self.window_queries.setdefault(req_id, {}).setdefault(layer, []).append(queries)

    def take_window(self, req_id: str, layer: int, last: torch.Tensor) -> torch.Tensor:
        """All window queries of a prompt for one layer, [q_heads, window, head_dim], on their device."""
        earlier = self.window_queries.get(req_id, {}).pop(layer, [])
        return torch.cat([*earlier, last]).transpose(0, 1)

    def add_column_sums(self, req_id: str, layer: int, sums: torch.Tensor) -> None:
        """Add a summed chunk's column sums [q_heads, keys so far] to the prompt's running ones of a layer."""
        layers = self.column_sums.setdefault(req_id, {})
        earlier = layers.get(layer)
        if earlier is not None:
            sums[:, : earlier.shape[1]] += earlier  # this chunk saw every earlier key, and its own
        layers[layer] = sums

    def take_column_sums(self, req_id: str, layer: int, length: int) -> torch.Tensor | None:
        """A layer's running column sums of the prompt, zero-padded to ``length`` keys; None if no chunk was summed."""
        layers = self.column_sums.get(req_id, {})
        sums = layers.pop(layer, None)
        if not layers:
            self.column_sums.pop(req_id, None)
        if sums is None:
            return None
        return torch.nn.functional.pad(sums, (0, length - sums.shape[1]))

    def observe(self, req_id: str, layer: int, kv_cache: torch.Tensor, observation: Any) -> dict:
        """Record a layer's cache and observation of a prompt; all layers so far, emptied once the last arrives."""
        observed = self.observed.setdefault(req_id, {})
        observed[layer] = (kv_cache, observation)
        if len(observed) == self.requests[req_id].num_layers:
            del self.observed[req_id]
        return observed

    def writable_blocks(self, req_id: str, num_blocks: int) -> tuple[list[int], bool]:
        """The block-table positions a request may write this step, in the order to fill them
        (``write_order`` over ``block_sharing``), and whether other requests read some of its blocks."""
        shared, cached = self.block_sharing.get(req_id, ((), ()))
        return write_order(num_blocks, shared, cached), bool(shared)

    def leave_uncompressed(self, req_id: str) -> None:
        """A prompt whose own blocks cannot hold what its policy keeps stays on the stock path."""
        self.uncompressed.add(req_id)
        self.counters["shared_prefix_uncompressed"] += 1

    def forget(self, req_ids) -> None:
        for req_id in req_ids or ():
            self.requests.pop(req_id, None)
            self.window_queries.pop(req_id, None)
            self.column_sums.pop(req_id, None)
            self.observed.pop(req_id, None)
            self.carried.pop(req_id, None)
            self.uncompressed.discard(req_id)
            offloaded = self.offloaded.pop(req_id, None)
            if offloaded is not None:
                self.host.release(offloaded.host_page_ids(), offloaded.host_reserved)

    def memory_now(self) -> dict[str, int]:
        """The memory compression saves right now (``metrics.GAUGES``): requests holding fewer blocks
        than their tokens in the cache would fill uncompressed, their blocks and bytes."""
        requests = blocks = full_blocks = 0
        for req_id, request in (*self.requests.items(), *self.offloaded.items()):
            state = self.runner.requests.get(req_id)
            held = request.live_blocks()
            full = 0 if state is None else -(-state.num_computed_tokens // request.block_size)
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

    def take_report(self) -> dict[str, int]:
        """Counter increments since the last report, and the memory snapshot when it changed."""
        report = {key: value for key, value in self.counters.items() if value}
        self.counters.clear()
        memory = self.memory_now()
        if memory != self._reported_memory:
            report.update(memory)
            self._reported_memory = memory
        return report


WORKER_STATE = WorkerState()
