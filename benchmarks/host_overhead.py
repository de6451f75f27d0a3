"""Host time of kvpolicy's CUDA step at an 8B shape: everything a GPU step waits for but the kernels.

    python benchmarks/host_overhead.py            # batches 1, 16, 64, 256; writes results/host_overhead.json, .md, .png
    python benchmarks/host_overhead.py --quick    # batches 1 and 16, fewer steps

Drives the real CUDA-path code on this CPU with the kernels and device copies stubbed, so what is timed is the host
work a GPU step waits for; copies between host and device are counted. Method and columns:
docs/benchmarks.md#host-overhead-runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

os.environ.setdefault("TRITON_INTERPRET", "1")  # TritonOps refuses to start without a GPU otherwise; no kernel runs
sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

import kvpolicy.vllm.worker.ops.triton as triton_ops  # noqa: E402
from benchmarks.common import RESULTS_DIR, write_results  # noqa: E402
from kvpolicy.config import KVPolicyConfig  # noqa: E402
from kvpolicy.vllm.worker.modes import StepShape, fixed_decode, make_mode, make_path  # noqa: E402
from kvpolicy.vllm.worker.ops import staging  # noqa: E402
from kvpolicy.vllm.worker.state import WorkerState  # noqa: E402
from kvpolicy.vllm.worker.step import FixedDecodeStep  # noqa: E402
from kvpolicy.vllm.worker.step_builder import StepBuilder  # noqa: E402

SHAPE = {"num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16}
CONTEXT, BUDGET, CHUNK = 4096, 1024, 2048
DTYPE = torch.bfloat16
PRESETS = {
    "full": {"batches": [1, 16, 64, 256], "steps": 20},
    "quick": {"batches": [1, 16], "steps": 5},
}
#: The bounds a decode step's host side is held to (what CUDA graphs would not hide of it): host time at
#: batch 256, and kvpolicy's kernel launches per layer (the write of the new K/V and the attention).
HOST_MS_BOUND_AT_256 = 1.0
LAUNCHES_PER_LAYER_BOUND = 2
#: Besides, the builder's launches: the device page tables' update (rows rewritten, entries set).
BUILDER_LAUNCHES_BOUND = 2
#: A decode step in fixed shapes launches nothing per layer outside its graph: the builder's copies into the
#: buffers (the padding's fills; lengths, slots, page tables of relocated and of stock rows) and the page
#: tables' update, whatever the layer count.
FIXED_LAUNCHES_BOUND = 10
COLUMNS = [
    "step",
    "batch",
    "build_ms",
    "layers_ms",
    "host_ms",
    "host_ms_per_row",
    "launches",
    "h2d_copies",
    "h2d_bytes",
    "d2h_copies",
    "d2h_bytes",
    "within_bounds",
]
KVPOLICY_DIR = str(Path(triton_ops.__file__).resolve().parents[2])


class Traffic:
    """Host<->device copies the CUDA path would make: the ops' ``copy_to`` (host to device), and every
    ``Tensor.cpu`` called from kvpolicy's code (device to host; on this CPU both are no-ops)."""

    def __init__(self):
        self.counts: Counter = Counter()

    @contextmanager
    def recording(self):
        real_copy, real_cpu = staging.copy_to, torch.Tensor.cpu
        counts = self.counts

        def copy_to(device, tensors):
            counts["h2d_copies"] += len(tensors)
            counts["h2d_bytes"] += sum(t.nbytes for t in tensors)
            return real_copy(device, tensors)

        def cpu(tensor, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(KVPOLICY_DIR):
                counts["d2h_copies"] += 1
                counts["d2h_bytes"] += tensor.nbytes
            return real_cpu(tensor, *args, **kwargs)

        staging.copy_to, torch.Tensor.cpu = copy_to, cpu
        try:
            yield
        finally:
            staging.copy_to, torch.Tensor.cpu = real_copy, real_cpu


#: Kernel launches of the stubbed kernels, by the step that made them (``counted``).
LAUNCHES = Counter()


def counted(kernel):
    """A stubbed kernel that counts its launches."""

    def launch(*args):
        LAUNCHES["kernels"] += 1
        return kernel(*args)

    return launch


#: The stubbed kernels (``kernels_stubbed``), by name: ``launches_counted`` wraps them.
KERNELS = ("paged_attention", "write_slots", "move_tokens", "scatter_tokens", "gather_tokens", "new_token_weights")


def counted_buffer_writes(seq_lens, slots, tables, padding, relocated, stock, *_) -> None:
    """``fixed_decode.write_buffers``'s device operations: the padding's two fills, three copies for the
    relocated sequences and three for the stock ones."""
    LAUNCHES["kernels"] += 2 + 3 * bool(relocated.numel()) + 3 * bool(stock.numel())


def counted_table_updates(tables, rows, contents, flat, values) -> None:
    """``staging.update_tables``'s device operations: the rows rewritten, the entries set."""
    LAUNCHES["kernels"] += bool(rows.numel()) + bool(flat.numel())


@contextmanager
def replaced(module, stand_ins: dict):
    """``module``'s attributes named in ``stand_ins`` replaced by them inside the block, restored after."""
    saved = {name: getattr(module, name) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(module, name, real)


@contextmanager
def launches_counted():
    """The stubbed kernels count their launches in ``LAUNCHES``: for steps that are not timed, so the
    counting is not part of the host time measured."""
    with (
        replaced(triton_ops, {name: counted(getattr(triton_ops, name)) for name in KERNELS}),
        replaced(fixed_decode, {"write_buffers": counted_buffer_writes}),
        replaced(staging, {"update_tables": counted_table_updates}),
    ):
        yield


@contextmanager
def kernels_stubbed():
    """The Triton ops' kernels and the page tables' update on the device do nothing; ``gather_tokens`` returns
    random K/V of the right size."""
    head_size = SHAPE["head_size"]

    def gather(cache, geometry, slots):
        return (torch.randn(slots.numel(), head_size, dtype=DTYPE), torch.randn(slots.numel(), head_size, dtype=DTYPE))

    def weights(query, cache, geometry, token_of, head_of, table, seq_lens, scale, kv_heads):
        return torch.zeros(seq_lens.numel(), int(seq_lens.max()))

    def nothing(*args):
        return None

    stubs = {
        "paged_attention": nothing,
        "write_slots": nothing,
        "move_tokens": nothing,
        "scatter_tokens": nothing,
        "gather_tokens": gather,
        "new_token_weights": weights,
        "cache_geometry": nothing,
    }
    # Scatters into the device's page tables and copies into the fixed-shape buffers: device work on a GPU.
    with (
        replaced(triton_ops, stubs),
        replaced(staging, {"update_tables": nothing}),
        replaced(fixed_decode, {"write_buffers": nothing}),
    ):
        yield


def uneven_head_lengths(rng: np.random.Generator, layers: int, heads: int, budget: int) -> np.ndarray:
    """[layers, heads] kept tokens per head, between half and twice ``budget``, each layer summing to ``heads * budget``."""
    lengths = np.full((layers, heads), budget)
    for layer in range(layers):
        for _ in range(4 * heads):
            give, take = rng.integers(heads, size=2)
            amount = int(rng.integers(0, budget // 4))
            if lengths[layer, give] - amount >= budget // 2 and lengths[layer, take] + amount <= 2 * budget:
                lengths[layer, give] -= amount
                lengths[layer, take] += amount
    return lengths


class SyntheticEngine:
    """What the CUDA backend sees of vLLM: the runner's requests, the per-layer caches (one block each: the
    stubbed kernels never read them; page pools per layer, as on CUDA), and each step's ``CommonAttentionMetadata``."""

    def __init__(self, policy: str, budget: int, fixed: bool = False):
        # The previous case's engine is garbage in reference cycles (a page store's rows point back at it):
        # freed here, or Python's collector frees its hundreds of MB inside this case's timed steps.
        gc.collect()
        layers, heads, block = SHAPE["num_layers"], SHAPE["num_kv_heads"], SHAPE["block_size"]
        self.blocks_per_request = -(-(2 * CONTEXT) // block)
        self.next_block = 0
        self.requests: dict[str, SimpleNamespace] = {}
        self.tables: dict[str, list[int]] = {}
        # vLLM's block table: one persistent tensor whose rows change only when the batch's requests do
        # (``BlockTable.add_row``), not rebuilt before each step; ``table_rows`` is whose row each one holds.
        self.block_table = torch.zeros(0, self.blocks_per_request, dtype=torch.int32)
        self.table_rows: list[str | None] = []
        caches = [torch.empty(1, heads, block, 2 * SHAPE["head_size"], dtype=DTYPE)] * layers
        self.runner = SimpleNamespace(requests=self.requests, input_batch=SimpleNamespace(req_ids=[]), kv_caches=caches)
        self.worker = WorkerState.of(KVPolicyConfig(policy=policy, budget=budget, page_pool="layer"), self.runner)
        self.worker.mode = make_mode(self.worker)
        impl = SimpleNamespace(scale=SHAPE["head_size"] ** -0.5, num_kv_heads=heads)
        self.layers = [SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn", impl=impl) for i in range(layers)]
        self.ops = triton_ops.TritonOps()
        shape = StepShape(
            num_layers=layers,
            num_kv_heads=heads,
            queries_per_kv=SHAPE["num_heads"] // heads,
            block_size=block,
            max_model_len=2 * CONTEXT,
            plan=self.ops.plan,
        )
        mode = self.worker.mode
        self.builder = StepBuilder(self.worker, mode, make_path(mode, self.ops), self.ops, shape)
        if fixed:  # decode batches in the fixed shapes of full CUDA graphs, up to the largest batch measured
            assert mode.enable_fixed_decode(self.ops, shape, max(PRESETS["full"]["batches"]), SHAPE["head_size"], "cpu")
        self.rng = np.random.default_rng(0)

    def add_request(self, req_id: str, computed: int, compressed: bool) -> None:
        """A request of a ``CONTEXT``-token prompt with ``computed`` tokens in the cache; ``compressed``: its
        prompt already relocated to Ada-KV's uneven per-head lengths."""
        table = list(range(self.next_block, self.next_block + self.blocks_per_request))
        self.next_block += self.blocks_per_request
        self.tables[req_id] = table
        self.requests[req_id] = SimpleNamespace(
            num_prompt_tokens=CONTEXT,
            num_tokens=CONTEXT,
            num_computed_tokens=computed,
            sampling_params=SimpleNamespace(extra_args=None),
        )
        if compressed:
            layers, heads, block = SHAPE["num_layers"], SHAPE["num_kv_heads"], SHAPE["block_size"]
            pages = self.worker.mode.new_pages(table[: -(-CONTEXT // block)], None, None, self.builder.shape)
            for layer, counts in enumerate(uneven_head_lengths(self.rng, layers, heads, BUDGET)):
                pages.relocate(layer, [torch.arange(int(n)) for n in counts])
            pages.release_except(pages.blocks_to_keep(CONTEXT))  # the spare blocks go back to vLLM, as after relocation
            self.worker.mode.track(req_id).pages = pages

    def metadata(self, rows: list[tuple[str, int]]) -> SimpleNamespace:
        """vLLM's metadata of a step whose rows are (request, new tokens); advances each request by them."""
        for req_id, new in rows:
            request = self.requests[req_id]
            request.num_computed_tokens += new
            request.num_tokens = max(CONTEXT, request.num_computed_tokens)
        if len(rows) > len(self.table_rows):
            extra = len(rows) - len(self.table_rows)
            self.block_table = torch.cat(
                [self.block_table, torch.zeros(extra, self.blocks_per_request, dtype=torch.int32)]
            )
            self.table_rows.extend([None] * extra)
        for index, (req_id, _) in enumerate(rows):
            if self.table_rows[index] != req_id:
                self.block_table[index] = torch.tensor(self.tables[req_id], dtype=torch.int32)
                self.table_rows[index] = req_id
        block_table = self.block_table[: len(rows)]
        self.runner.input_batch.req_ids = [req_id for req_id, _ in rows]
        self.runner.input_batch.block_table = [SimpleNamespace(get_cpu_tensor=lambda: block_table)]
        query_lens = torch.tensor([new for _, new in rows], dtype=torch.int32)
        query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
        query_start_loc[1:] = query_lens.cumsum(0)
        seq_lens = torch.tensor([self.requests[r].num_computed_tokens for r, _ in rows], dtype=torch.int32)
        return SimpleNamespace(
            num_reqs=len(rows),
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=seq_lens,
            block_table_tensor=block_table,
        )

    def run_step(self, rows: list[tuple[str, int]]) -> tuple[float, float]:
        """Build the step and run every layer's host glue; (build seconds, layers seconds)."""
        cam = self.metadata(rows)
        tokens = int(cam.query_start_loc_cpu[-1])
        heads, kv_heads, head_size = SHAPE["num_heads"], SHAPE["num_kv_heads"], SHAPE["head_size"]
        query = torch.zeros(tokens, heads, head_size, dtype=DTYPE)
        key = torch.zeros(tokens, kv_heads, head_size, dtype=DTYPE)
        out = torch.empty_like(query)
        cache = self.runner.kv_caches[0]
        start = time.perf_counter()
        step = self.builder.build(cam)  # staged, as the backends' metadata builders do
        built = time.perf_counter()
        # A fixed-shape step's layers are a graph's replay on a GPU: their Python does not run.
        for layer in [] if isinstance(step, FixedDecodeStep) else self.layers:
            step.write(layer, key, key, cache, platform_nothing)  # as ``KVPolicyAttention`` runs a step
            step.attend(layer, query, out, cache, platform_nothing)  # vLLM's own calls left out
        done = time.perf_counter()
        self.worker.releases.clear()
        return built - start, done - built


def platform_nothing(*_) -> None:
    """vLLM's own write and attention, left out of what is timed."""


def measure(batch: int, steps: int, mixed: bool, policy: str, fixed: bool = False) -> dict:
    engine = SyntheticEngine(policy, BUDGET, fixed)
    decoding = [f"decode-{i}" for i in range(batch)]
    for req_id in decoding:
        engine.add_request(req_id, CONTEXT, compressed=True)
    traffic = Traffic()
    builds, layers, launches = [], [], []

    def step_rows(prompt: str) -> list[tuple[str, int]]:
        """A step's rows: every decode, then (mixed) a new prompt in the row the last one left, after the
        decodes (``InputBatch.add_request``)."""
        rows = [(req_id, 1) for req_id in decoding]
        if mixed:
            engine.add_request(prompt, 0, compressed=False)
            rows.append((prompt, CHUNK))
        return rows

    for step in range(steps + 1):
        rows = step_rows(f"prompt-{step}")
        if step == 0:  # warm-up: caches of the first step
            engine.run_step(rows)
            continue
        with traffic.recording():
            build_s, layers_s = engine.run_step(rows)
        builds.append(build_s)
        layers.append(layers_s)
    for step in range(steps):  # the same steps again, untimed, counting launches
        rows = step_rows(f"counted-prompt-{step}")
        LAUNCHES.clear()
        with launches_counted():
            engine.run_step(rows)
        launches.append(LAUNCHES["kernels"])
    build_ms, layers_ms = 1e3 * statistics.median(builds), 1e3 * statistics.median(layers)
    per_step = {key: value // steps for key, value in traffic.counts.items()}
    within = per_step.get("d2h_copies", 0) == 0
    if not mixed:  # a decode step: the launch bound, and the time bound at batch 256
        per_layer = LAUNCHES_PER_LAYER_BOUND * SHAPE["num_layers"] + BUILDER_LAUNCHES_BOUND
        within &= max(launches) <= (FIXED_LAUNCHES_BOUND if fixed else per_layer)
        within &= batch != 256 or build_ms + layers_ms <= HOST_MS_BOUND_AT_256
    step = f"{batch} decodes + {CHUNK}-token chunk" if mixed else f"{batch} decodes"
    return {
        "step": f"{step}, fixed shapes (layers in a graph)" if fixed else step,
        "batch": batch,
        "mixed": mixed,
        "fixed": fixed,
        "build_ms": build_ms,
        "layers_ms": layers_ms,
        "host_ms": build_ms + layers_ms,
        "host_ms_per_row": (build_ms + layers_ms) / batch,
        "launches": max(launches),
        "within_bounds": within,
        "h2d_copies": per_step.get("h2d_copies", 0),
        "h2d_bytes": per_step.get("h2d_bytes", 0),
        "d2h_copies": per_step.get("d2h_copies", 0),
        "d2h_bytes": per_step.get("d2h_bytes", 0),
    }


def measure_prompt(policy: str) -> dict:
    """One 4K prompt whose last chunk completes it this step, relocated in every layer."""
    engine = SyntheticEngine(policy, BUDGET)
    engine.add_request("prompt", 0, compressed=False)
    engine.run_step([("prompt", CONTEXT - CHUNK)])
    traffic = Traffic()
    with traffic.recording():
        build_s, layers_s = engine.run_step([("prompt", CHUNK)])
    counts = traffic.counts
    return {
        "step": f"compress one {CONTEXT}-token prompt (last {CHUNK}-token chunk)",
        "batch": 1,
        "mixed": True,
        "build_ms": 1e3 * build_s,
        "layers_ms": 1e3 * layers_s,
        "host_ms": 1e3 * (build_s + layers_s),
        "host_ms_per_row": None,
        "scoring_on_host": True,
        **{key: counts.get(key, 0) for key in ("h2d_copies", "h2d_bytes", "d2h_copies", "d2h_bytes")},
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    kinds = (
        (False, False, "decode step"),
        (False, True, "decode step, fixed shapes"),
        (True, False, f"decodes + {CHUNK}-token chunk"),
    )
    for mixed, fixed, label in kinds:
        series = [
            r for r in rows if r["mixed"] == mixed and r.get("fixed") == fixed and r["host_ms_per_row"] is not None
        ]
        batches = [r["batch"] for r in series]
        axes[0].plot(batches, [r["host_ms"] for r in series], marker="o", label=label)
        axes[1].plot(batches, [r["launches"] for r in series], marker="o", label=label)
    axes[0].axhline(1.0, color="grey", linestyle="--", label="goal at batch 256: 1 ms")
    for ax, ylabel in ((axes[0], "host ms per step"), (axes[1], "kernel launches outside a CUDA graph per step")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (decoding requests)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle("kvpolicy's host side of a CUDA step, 8B shape, adasnap@1024 (kernels stubbed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batches 1 and 16, 5 steps each")
    parser.add_argument("--policy", default="adasnap")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    preset = PRESETS["quick" if args.quick else "full"]
    out = args.out or RESULTS_DIR / ("host_overhead_quick.json" if args.quick else "host_overhead.json")
    torch.set_num_threads(1)  # the host side of a step is one Python thread
    cases = [(batch, mixed, fixed) for batch in preset["batches"] for mixed, fixed in ((0, 0), (0, 1), (1, 0))]
    rows = []
    with kernels_stubbed():
        for batch, mixed, fixed in tqdm(cases, desc="steps"):
            rows.append(measure(batch, preset["steps"], bool(mixed), args.policy, bool(fixed)))
        rows.append(measure_prompt(args.policy))
    settings = {
        "shape": SHAPE,
        "context": CONTEXT,
        "budget": BUDGET,
        "chunk": CHUNK,
        "policy": args.policy,
        "dtype": str(DTYPE),
        **preset,
    }
    write_results(out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
