"""No decode step of any policy family reads back what lies on the device.

The step path runs as the engine runs it (the mode builds the step, the builder's ops stage it, every layer writes and
attends through ``step.write`` / ``step.attend``) over a KV cache on the ``meta`` device, which stands for a GPU whose
data never reaches the host. A shim records every host read of such a tensor (``.item()``, ``.tolist()``,
``.cpu()``, ``.numpy()``, truth values, ``nonzero``, a boolean mask) and every op mixing a device tensor with a host
one. Decode steps of relocated requests (the evicting policies between their passes), OmniKV's selection, PoD's
layout and decode (with and without tau), and steps mixing a prompt chunk on the stock rows with them, record
nothing. Read back once per request, not per step: Ada-KV's per-head counts and D2O's layer budgets, once for every
layer of a relocated prompt (counted here), and OmniKV's choice for offloaded rows.
"""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvpolicy.config import KVPolicyConfig
from kvpolicy.vllm.worker.modes import StepShape, make_mode, make_path
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.state import WorkerState
from kvpolicy.vllm.worker.step import FixedDecodeStep
from kvpolicy.vllm.worker.step_builder import StepBuilder

LAYERS, KV_HEADS, GROUP, HEAD_SIZE, BLOCK = 4, 2, 2, 16, 16
CONTEXT, BUDGET, CHUNK = 160, 64, 48
DEVICE = torch.device("meta")
#: The ops that launch device work.
LAUNCHING = {
    "write",
    "attend",
    "gather",
    "scatter",
    "move",
    "new_token_weights",
    "context_attention",
    "pod_attention",
    "copy_pages",
    "load_pages",
}
READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select"}
#: Ops that may take a host tensor beside a device one: copies to the device.
COPIES = {"to", "copy_", "__get__"}


class HostReads(TorchFunctionMode):
    """Records each host read of a ``meta`` tensor and each op mixing one with a host tensor of any size,
    with the kvpolicy line that made it. ``answer``: a ``.tolist()`` of a meta tensor is answered with that
    value in every place (there is no data to read) instead of raising, so a step that reads back runs on."""

    def __init__(self, answer: int | None = None):
        super().__init__()
        self.records: list[str] = []
        self.answer = answer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [t for t in _tensors((args, kwargs))]
        if any(t.is_meta for t in tensors):
            mask = name in ("__getitem__", "__setitem__") and any(
                isinstance(t, torch.Tensor) and t.is_meta and t.dtype == torch.bool for t in _tensors(args[1:2])
            )
            mixed = name not in COPIES and any(not t.is_meta and t.dim() > 0 for t in tensors)
            if name in READS or mask or mixed:
                self.records.append(f"{name} ({'mixes host and device' if mixed else 'reads back'}) at {_caller()}")
            if name == "tolist" and self.answer is not None:
                return torch.full(args[0].shape, self.answer).tolist()
        return func(*args, **kwargs)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/kvpolicy/" in f.filename and "/tests/" not in f.filename]
    return f"{frames[-1].filename.split('/kvpolicy/')[-1]}:{frames[-1].lineno}" if frames else "?"


class DeviceOps(KVOps):
    """Ops whose results lie where the cache is; nothing is computed (the kernels' own tests do that). Counts
    the calls that launch work on the device (``launches``): on a GPU each is a kernel or two."""

    def __init__(self):
        self.launches = 0

    def __getattribute__(self, name):
        if name in LAUNCHING:
            object.__setattr__(self, "launches", object.__getattribute__(self, "launches") + 1)
        return object.__getattribute__(self, name)

    def plan(self, query_start_loc, seq_lens, block_table, kv_heads, queries_per_kv):
        return None

    def on_device(self, tensor, device):
        return tensor.to(device)

    def write(self, layer, cache, key, value, rows, slots):
        pass

    def attend(self, layer, query, out, cache, batch, rows=None):
        pass

    def gather(self, layer, cache, slots):
        return tuple(torch.empty(slots.numel(), HEAD_SIZE, device=cache.device) for _ in range(2))

    def scatter(self, layer, cache, slots, keys, values):
        pass

    def move(self, layer, cache, src, dst):
        pass

    def new_token_weights(self, layer, query, cache, batch, rows):
        return torch.zeros(batch.seq_lens.numel(), int(batch.seq_lens.max()), dtype=torch.float64, device=cache.device)

    def context_attention(self, layer, query, out, cache, page_ids, token_idx, lengths):
        return torch.zeros(page_ids.shape[0], page_ids.shape[2], dtype=torch.float64, device=cache.device)

    def pod_attention(self, layer, query, out, cache, call):
        return torch.zeros(call.token_of.numel(), GROUP, dtype=torch.bool, device=cache.device)


class MetaEngine:
    """What the builders and paths see of vLLM: its runner (requests, the batch's block table), the KV
    caches (one buffer on ``meta``, each layer a contiguous slice), and each step's batch metadata."""

    def __init__(self, config: KVPolicyConfig, ops: KVOps | None = None):
        blocks_per_layer = 128
        per_layer = blocks_per_layer * KV_HEADS * BLOCK * 2 * HEAD_SIZE
        buffer = torch.empty(LAYERS * per_layer, device=DEVICE)
        caches = [
            buffer[i * per_layer : (i + 1) * per_layer].view(blocks_per_layer, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
            for i in range(LAYERS)
        ]
        self.runner = SimpleNamespace(kv_caches=caches, requests={}, input_batch=SimpleNamespace(req_ids=[]))
        self.worker = WorkerState.of(config, self.runner)
        self.mode = self.worker.mode = make_mode(self.worker)
        self.ops = ops = ops or DeviceOps()
        shape = StepShape(LAYERS, KV_HEADS, GROUP, BLOCK, 4 * CONTEXT, ops.plan)
        self.builder = StepBuilder(self.worker, self.mode, make_path(self.mode, ops), ops, shape)
        self.tables: dict[str, list[int]] = {}
        self.layers = [
            SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn", impl=SimpleNamespace(scale=0.25))
            for i in range(LAYERS)
        ]

    def add(self, req_id: str, prompt_len: int, computed: int = 0) -> list[int]:
        first = 16 * len(self.tables)
        self.tables[req_id] = list(range(first, first + 16))
        self.runner.requests[req_id] = SimpleNamespace(
            num_prompt_tokens=prompt_len,
            num_tokens=max(prompt_len, computed),
            num_computed_tokens=computed,
            sampling_params=SimpleNamespace(extra_args=None),
        )
        return self.tables[req_id]

    def relocated(self, req_id: str, kept: int) -> None:
        """A request whose prompt was relocated keeping ``kept`` tokens in every head, with what an evicting
        policy carries."""
        blocks = self.add(req_id, CONTEXT, CONTEXT)
        shape = self.builder.shape
        pages = self.mode.new_pages(blocks[: -(-CONTEXT // BLOCK)], None, None, shape)
        for layer in range(LAYERS):
            pages.relocate(layer, [torch.arange(kept)] * KV_HEADS)
        pages.release_except(pages.blocks_to_keep(CONTEXT))
        self.mode.track(req_id).pages = pages
        policy = self.worker.policy
        if policy.schedule.in_decode:
            carried = self.mode.carried(req_id)
            for layer in range(LAYERS):
                carried.budgets[layer] = kept
                carried.scored[layer] = policy.inputs.attention
                if policy.inputs.attention:
                    self.mode.scores.write(layer, carried.slot, torch.zeros(KV_HEADS, kept, device=DEVICE))

    def step(self, rows: list[tuple[str, int]], padding: int = 0, answer: int | None = None) -> list[str]:
        """One step of ``rows`` (request, new tokens): built, staged and run through every layer under the shim.
        ``padding``: rows past the requests, as vLLM pads a batch it replays in a full CUDA graph (no token, length
        0, the null block), with as many padded tokens. ``answer``: what the shim answers a read back with."""
        requests = self.runner.requests
        for req_id, new in rows:
            requests[req_id].num_tokens = max(requests[req_id].num_tokens, requests[req_id].num_computed_tokens + new)
        query_lens = torch.tensor([new for _, new in rows] + [0] * padding, dtype=torch.int32)
        query_start_loc = torch.zeros(len(rows) + padding + 1, dtype=torch.int32)
        query_start_loc[1:] = query_lens.cumsum(0)
        seq_lens = torch.tensor(
            [requests[r].num_computed_tokens + new for r, new in rows] + [0] * padding, dtype=torch.int32
        )
        block_table = torch.tensor([self.tables[r] for r, _ in rows] + [[0] * 16] * padding, dtype=torch.int32)
        self.runner.input_batch.req_ids = [r for r, _ in rows]
        self.runner.input_batch.block_table = [SimpleNamespace(get_cpu_tensor=lambda: block_table)]
        cam = SimpleNamespace(
            num_reqs=len(rows) + padding, query_start_loc_cpu=query_start_loc, seq_lens_cpu_upper_bound=seq_lens
        )
        tokens = int(query_start_loc[-1]) + padding
        query = torch.empty(tokens, KV_HEADS * GROUP, HEAD_SIZE, device=DEVICE)
        key = torch.empty(tokens, KV_HEADS, HEAD_SIZE, device=DEVICE)
        out = torch.empty_like(query)
        with HostReads(answer) as shim:
            step = self.builder.build(cam)
            assert step is not None
            for layer, cache in zip(self.layers, self.runner.kv_caches):
                step.write(layer, key, key, cache, lambda idx: None if idx is None else key[idx])
                step.attend(layer, query, out, cache, lambda: None)
        self.worker.take_releases()
        for req_id, new in rows:
            requests[req_id].num_computed_tokens += new
        return shim.records


RELOCATING = ["identity", "snapkv", "adasnap", "pyramid", "adamix", "streaming", "keydiff", "h2o", "d2o"]


@pytest.mark.parametrize("policy", RELOCATING)
def test_decode_steps_of_relocated_requests_read_nothing_back(policy):
    budget = None if policy == "identity" else BUDGET
    engine = MetaEngine(KVPolicyConfig(policy=policy, budget=budget, window=8, page_pool="layer"))
    for i in range(3):
        engine.relocated(f"r{i}", CONTEXT if budget is None else budget)
    decode = [(f"r{i}", 1) for i in range(3)]
    for _ in range(3):
        assert engine.step(decode) == []
    engine.add("prompt", 2 * CHUNK)
    assert engine.step([*decode, ("prompt", CHUNK)]) == [], "a prompt chunk on the stock rows beside them"


#: Relocating policies whose choice needs host values from the device: Ada-KV's per-head counts, D2O's layer budgets.
SETTLED_ONCE = {"adasnap", "adapyramid", "adamix", "d2o"}


@pytest.mark.parametrize("policy", [*RELOCATING, "adapyramid"])
def test_a_prompt_is_relocated_in_every_layer_with_at_most_one_read_back(policy):
    """Compressing a prompt reads back only what sizes its pages, and that once for all layers (after the
    last), not once a layer: on an H200 each read is a stall of the whole step."""
    budget = None if policy == "identity" else BUDGET
    engine = MetaEngine(KVPolicyConfig(policy=policy, budget=budget, window=8, page_pool="layer"))
    engine.add("prompt", CONTEXT)
    records = engine.step([("prompt", CONTEXT)], answer=4)
    assert engine.worker.counters["relocated_requests"] == 1
    if policy in SETTLED_ONCE:
        assert len(records) == 1 and records[0].startswith("tolist (reads back) at policies/"), records
    else:
        assert records == []


def test_omnikvs_filter_layers_choose_on_the_device():
    engine = MetaEngine(KVPolicyConfig(policy="omnikv", budget=BUDGET, filter_layers=(1,), dense_layers=1))
    decode = []
    for i in range(3):
        engine.add(f"r{i}", CONTEXT, CONTEXT)
        decode.append((f"r{i}", 1))
    for _ in range(3):
        assert engine.step(decode) == []
    engine.add("prompt", 2 * CHUNK)
    assert engine.step([*decode, ("prompt", CHUNK)]) == []


@pytest.mark.parametrize("tau", [None, 0.7], ids=["every-distant-token", "tau"])
def test_pods_layout_and_decode_read_nothing_back(tau, tmp_path):
    import json

    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({"blocks": [[[0, 1], [2, 3]]] * KV_HEADS}))
    engine = MetaEngine(
        KVPolicyConfig(policy="pod", sink_tokens=4, recent_tokens=32, pod_groups=str(groups), pod_tau=tau)
    )
    engine.add("r", CONTEXT)
    assert engine.step([("r", CONTEXT)]) == [], "the prompt completes: laid out after the last layer"
    assert engine.worker.counters["pod_layouts"] == 1
    for _ in range(3):
        assert engine.step([("r", 1)]) == []


def test_the_shim_sees_a_read_back_and_host_indices():
    with HostReads() as shim:
        cache = torch.empty(4, device=DEVICE)
        cache[torch.tensor([0, 1])]
        with pytest.raises(RuntimeError):
            cache.sum().item()
    assert [record.split(" ")[0] for record in shim.records] == ["__getitem__", "item"]


#: kvpolicy's launches per layer in a decode step of relocated requests (the CPU proxy of what a GPU step pays
#: outside CUDA graphs): the new K/V's write and the attention; policies that add each new token's attention
#: to carried scores, one more for its weights.
LAUNCHES_PER_LAYER = {"snapkv": 2, "adasnap": 2, "streaming": 2, "h2o": 3, "d2o": 3}


@pytest.mark.parametrize("policy", sorted(LAUNCHES_PER_LAYER))
def test_a_decode_step_launches_a_bounded_number_of_kernels_per_layer_whatever_the_batch(policy):
    engine = MetaEngine(KVPolicyConfig(policy=policy, budget=BUDGET, window=8, page_pool="layer"))
    for batch in (1, 5):
        for i in range(batch):
            engine.relocated(f"b{batch}-{i}", BUDGET)
        engine.ops.launches = 0
        engine.step([(f"b{batch}-{i}", 1) for i in range(batch)])
        assert engine.ops.launches == LAUNCHES_PER_LAYER[policy] * LAYERS


class FixedShapeDeviceOps(DeviceOps):
    """``DeviceOps`` that keep the mode's page tables on the device as the Triton ops do (the fixed-shape
    buffers copy the relocated rows' tables from there) and plan fixed-shape calls."""

    def stage(self, step, tables=None):
        per_head = getattr(step, "per_head", None)
        if per_head is not None and tables is not None:
            tables.stage(per_head.store, [], DEVICE)

    def fixed_decode_plan(self, rows, max_seq_len, queries_per_kv, head_size, device):
        return None


def test_fixed_shape_decode_steps_read_nothing_back_and_launch_a_write_and_an_attention_a_layer():
    """The decode steps a GPU replays in full CUDA graphs (``modes/fixed_decode.py``): relocated rows and a
    row still in vLLM's layout, written into the buffers and run with one write and one attention call per
    layer, reading nothing back."""
    engine = MetaEngine(KVPolicyConfig(policy="adasnap", budget=BUDGET, window=8, page_pool="layer"),
                        FixedShapeDeviceOps())  # fmt: skip
    assert engine.mode.enable_fixed_decode(engine.ops, engine.builder.shape, 8, HEAD_SIZE, DEVICE)
    for i in range(3):
        engine.relocated(f"r{i}", BUDGET)
    engine.add("short", BUDGET - 8, BUDGET - 8)  # a prompt under the budget decodes in vLLM's layout
    decode = [*((f"r{i}", 1) for i in range(3)), ("short", 1)]
    for _ in range(3):
        engine.ops.launches = 0
        assert engine.step(decode) == []
        assert engine.ops.launches == 2 * LAYERS
    assert engine.step(decode, padding=2) == [], "a batch vLLM padded to the size of a graph it replays"
    assert engine.mode.fixed.steps == {4: 3, 6: 1}


def test_a_capture_batch_without_requests_runs_in_fixed_shapes():
    """vLLM captures a decode graph over a dummy batch: rows with one token each and no request. They are
    padding (length 0, no slot), and the step is the fixed-shape one every replay of that size will run."""
    engine = MetaEngine(KVPolicyConfig(policy="snapkv", budget=BUDGET, page_pool="layer"), FixedShapeDeviceOps())
    assert engine.mode.enable_fixed_decode(engine.ops, engine.builder.shape, 8, HEAD_SIZE, DEVICE)
    block_table = torch.zeros(4, 16, dtype=torch.int32)
    engine.runner.input_batch.block_table = [SimpleNamespace(get_cpu_tensor=lambda: block_table)]
    cam = SimpleNamespace(
        num_reqs=4, query_start_loc_cpu=torch.arange(5, dtype=torch.int32), seq_lens_cpu_upper_bound=torch.ones(4)
    )
    with HostReads() as shim:
        step = engine.builder.build(cam)
    assert shim.records == []
    assert isinstance(step, FixedDecodeStep) and step.per_head is None
    assert step.inputs.requests == 0 and step.inputs.stock.numel() == 0, "every row is padding"
