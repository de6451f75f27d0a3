"""kvpolicy against plain vLLM with vLLM's own `vllm bench throughput`, over a tight, a same-batch and a loose KV pool.

    python benchmarks/gpu/throughput_sweep.py prepare           # here: the tokenizer that travels (.cache/gpu/tokenizer)
    python benchmarks/gpu/throughput_sweep.py run --out X.json  # on a GPU: Llama-3.1-8B's shape, random weights
    python benchmarks/gpu/throughput_sweep.py run --tiny        # the CPU rehearsal: a 2-layer Llama, short requests
    python benchmarks/gpu/throughput_sweep.py report X.json     # the table and plot again from a results JSON
    python benchmarks/gpu/throughput_sweep.py check X.json ...  # whether every row finished and filled WINDOW_FIELDS

Each row is one `vllm bench throughput` in its own process group under its own timeout (random dataset, dummy
weights of a ``config.json`` made here, ``--kv-cache-memory-bytes`` holding a whole number of requests), the bench's
``LLM`` wrapped to serve an untimed warm-up, then to count in its worker what the timed run did (``watch_worker``:
steps by CUDA graph mode, Triton compilations, host synchronisations) and sample its running requests and stalls.
``WINDOW`` is the GPU window's rows in order (``run.sh``); the JSON is rewritten as each row ends, and a row that
fails stops its config's later rows. Method, configs, fields and timings: benchmarks/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

STARTED = time.perf_counter()

ROOT = Path(__file__).resolve().parents[2]
# Appended, not prepended: an installed kvpolicy (the one vLLM's plugin entry point names) wins over the tree.
sys.path.append(str(ROOT))

from benchmarks.common import RESULTS_DIR, markdown_table, metric_total, provenance, write_json  # noqa: E402

#: kvpolicy's diagnostics switch (kvpolicy/vllm/worker/diagnostics.py), named here so this script imports no kvpolicy.
DIAGNOSE_ENV = "KVPOLICY_DIAGNOSE"

#: Where `prepare` puts what travels to the GPU machine (an ignored folder: carried, not committed).
CARRY_DIR = ROOT / ".cache" / "gpu"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: Model folders (config.json + tokenizer) are made on the machine that runs, not carried.
MODELS_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "kvpolicy-gpu-models"

#: config.json of each shape; the tokenizer is SmolLM2's, so bos/eos are its ids.
SHAPES = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
#: OmniKV needs a filter layer above its dense ones: the tiny model with 4 layers.
SHAPES["tiny-llama-4"] = {**SHAPES["tiny-llama"], "num_hidden_layers": 4}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

#: pools: ``fits`` whole requests (input + output tokens) of KV, ``prompts`` requests in the run.
PRESETS = {
    "gpu": {
        "shape": "llama-3.1-8b",
        "input_len": 4096,
        "output_len": 1024,
        "budget": 1024,
        "pools": {
            "tight": {"fits": 4, "prompts": 16},
            # 8 prompts in a pool that fits 8 whole: every config runs the same 8 at once, one wave, so the time
            # per output token compares decode steps side by side.
            "batch8": {"fits": 8, "prompts": 8},
            "middle": {"fits": 12, "prompts": 32},
            "loose": {"fits": 34, "prompts": 32},
        },
        "block_size": 16,
        # One engine configuration for every pool (vLLM's compile cache is keyed by it), and graphs captured at
        # the batch sizes the rows run only (16 at most).
        "engine_args": ["--max-num-seqs", "16", "--cudagraph-capture-sizes", "1", "2", "4", "8", "16"],
        # vLLM 0.32's sampler imports FlashInfer otherwise, which the bundle leaves out; the probe's counters are
        # functions sent to the engine's worker process (``LLM.collective_rpc``), which vLLM pickles only so.
        "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
        "run_timeout_s": 150,
        "min_run_s": 60,
    },
    "tiny": {
        "shape": "tiny-llama",
        "input_len": 256,
        "output_len": 8,
        "budget": 128,
        "pools": {
            "tight": {"fits": 2, "prompts": 4},
            "batch8": {"fits": 4, "prompts": 4},
            "middle": {"fits": 4, "prompts": 8},
            "loose": {"fits": 8, "prompts": 8},
        },
        "block_size": 128,
        "engine_args": ["--max-num-seqs", "8", "-O0"],
        # Nothing compiles in Triton's interpreter: the warm-up only runs the path once before the timed run.
        "warmup": {"prompts": 2, "output_len": 2},
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        "run_timeout_s": 240,
        "min_run_s": 20,
    },
}
#: OmniKV's host tier at 32K tokens (issue: requests running at once against plain vLLM in a pool that holds 2,
#: decode tokens/s, host-to-device bytes, how much of the copies the layers hide): its own presets.
PRESETS["offload"] = {
    **PRESETS["gpu"],
    "input_len": 32768,
    "output_len": 256,
    "budget": 2048,
    "offload_gib": 20,
    "pools": {"pool2": {"fits": 2, "prompts": 6}},
    "order": [("omnikv-offload", "pool2"), ("vllm-default", "pool2")],
    "run_timeout_s": 170,
    "min_run_s": 60,
}
PRESETS["offload-tiny"] = {
    **PRESETS["tiny"],
    "shape": "tiny-llama-4",
    "input_len": 512,
    "output_len": 8,
    "budget": 128,
    "offload_gib": 1,
    "omnikv_args": ["--kv-filter-layers", "1", "--kv-dense-layers", "1"],
    "pools": {"pool2": {"fits": 2, "prompts": 4}},
    "order": [("omnikv-offload", "pool2"), ("vllm-default", "pool2")],
}
#: Every row, on both platforms: vLLM's asynchronous scheduler (its CUDA default; the CPU's is synchronous).
WINDOW_ARGS = ["--async-scheduling"]
#: kvpolicy on CUDA: vLLM's LBHNC cache layout, where a one-head page's FlashAttention id is kvpolicy's own
#: (``FlashPages.same_ids``), so the fixed-shape decode graphs hand FlashAttention their page tables as they are.
KVPOLICY_CUDA_ENV = {"VLLM_KV_CACHE_LAYOUT": "LBHNC"}
#: kvpolicy on CPU, the window's path rehearsed (``cpu_ops``): its Triton ops in Triton's interpreter, with
#: ``fixed`` decode batches in the fixed shapes of the full CUDA graphs a GPU replays, as the engine tests run
#: them (``tests/e2e/engine_run.py``: ``run_the_gpu_ops_on_cpu``).
KVPOLICY_CPU_ENV = {"TRITON_INTERPRET": "1"}
#: ``cuda_args``/``cuda_env`` apply on CUDA only, ``cpu_args``/``cpu_env``/``cpu_ops`` on vLLM's CPU platform (one
#: attention backend, the V1 runner only; the model-wide page pool is its default and CUDA's refusal).
CONFIGS = {
    "vllm-default": {"label": "plain vLLM, its defaults", "args": []},
    "vllm-v1": {
        "label": "plain vLLM on the V1 model runner kvpolicy runs on (FlashAttention 3, asynchronous scheduler)",
        "args": [],
        "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    },
    "vllm-triton-v1": {
        "label": "plain vLLM with Triton attention on the V1 model runner",
        "args": [],
        "cuda_args": ["--attention-backend", "TRITON_ATTN"],
        "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    },
    "none": {
        "label": "--kv-policy none",
        "args": ["--kv-policy", "none"],
        "cuda_env": KVPOLICY_CUDA_ENV,
        "cpu_env": KVPOLICY_CPU_ENV,
        "cpu_ops": "triton",
    },
    "adasnap": {
        "label": "--kv-policy adasnap",
        "args": ["--kv-policy", "adasnap", "--kv-budget", "{budget}"],
        "cuda_env": KVPOLICY_CUDA_ENV,
        "cpu_args": ["--kv-page-pool", "layer"],
        "cpu_env": KVPOLICY_CPU_ENV,
        "cpu_ops": "fixed",
    },
    "adamix": {
        "label": "--kv-policy adamix",
        "args": ["--kv-policy", "adamix", "--kv-budget", "{budget}"],
        "cuda_env": KVPOLICY_CUDA_ENV,
        "cpu_args": ["--kv-page-pool", "layer"],
        "cpu_env": KVPOLICY_CPU_ENV,
        "cpu_ops": "fixed",
    },
    "omnikv-offload": {
        "label": "--kv-policy omnikv --kv-offload (sparse layers in a pinned host pool)",
        "args": ["--kv-policy", "omnikv", "--kv-budget", "{budget}", "--kv-offload", "{offload_gib}", "{omnikv_args}"],
        "cpu_env": KVPOLICY_CPU_ENV,
        "cpu_ops": "triton",
    },
}
BASELINES = {"vs_vllm_default": "vllm-default", "vs_vllm_v1": "vllm-v1"}
#: The GPU window's rows (``run.sh``), in order: what a user compares (the tight pool), the decode step at one
#: batch, what the V1 model runner kvpolicy runs on costs plain vLLM at that batch.
WINDOW = [
    ("adasnap", "tight"),
    ("vllm-default", "tight"),
    ("adasnap", "batch8"),
    ("vllm-default", "batch8"),
    ("vllm-v1", "batch8"),
]
#: Every row, most important first: the window's, then Triton attention, the loose and middle pools.
ORDER = [
    *WINDOW,
    ("vllm-triton-v1", "tight"),
    ("vllm-triton-v1", "batch8"),
    ("adasnap", "loose"),
    ("vllm-default", "loose"),
    ("adamix", "tight"),
    ("none", "tight"),
    ("vllm-triton-v1", "loose"),
    ("adamix", "loose"),
    ("none", "loose"),
    ("adasnap", "middle"),
    ("vllm-default", "middle"),
    ("vllm-triton-v1", "middle"),
    ("adamix", "middle"),
    ("none", "middle"),
]
#: Rows that also record kvpolicy's diagnostics (``KVPOLICY_DIAGNOSE``: host synchronisations inside its
#: calls, a profile of 20 decode steps), read into the row. Not a window row: the profiler starts and stops
#: inside a step of the timed run (``stall_s`` records what it cost there).
DIAGNOSED = {("omnikv-offload", "pool2")}
WARMUP = {"prompts": 2, "output_len": 16}
GENERATED = "vllm:generation_tokens"
#: ``host_syncs`` on vLLM's CPU platform: nothing runs apart from the host to wait for.
NO_DEVICE = "none: no device"
SAMPLE_EVERY_S = 0.1
THROUGHPUT_LINE = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s")
#: Log lines that say what vLLM actually ran (backend, runner, scheduler, graphs, start-up time).
FACT_LINE = re.compile(
    r"Using .*backend|FlashAttention version|Model Runner V2|Async scheduling|Graph capturing finished|"
    r"torch.compile took|Directly load the compiled|Model loading took|init engine"
)
COLUMNS = [
    "config",
    "pool",
    "pool_mib",
    "fits",
    "prompts",
    "output_tok_s",
    "total_tok_s",
    *BASELINES,
    "peak_running",
    "mean_running",
    "step_ms",
    "preemptions",
    "released_blocks_per_request",
    "kept_fraction",
    "async",
    "full_graph_steps",
    "piecewise_steps",
    "eager_steps",
    "fixed_steps",
    "triton_compiles",
    "host_syncs",
    "stall_s",
    "engine_start_s",
    "engine_s",
    "status",
]


def per_token_bytes(shape: dict) -> int:
    """KV bytes of one token over every layer: K and V, each KV head's head_dim values."""
    return (
        2
        * shape["num_hidden_layers"]
        * shape["num_key_value_heads"]
        * shape["head_dim"]
        * DTYPE_BYTES[shape["torch_dtype"]]
    )


def pool_bytes(preset: dict, pool: str) -> int:
    """``fits`` requests of input + output tokens, each in whole blocks of the platform's default size with one block
    more (the random dataset's prompts come out a token or two long now and then), and vLLM's null block, which no
    request holds: so ``fits`` requests run at once without a preemption."""
    block = preset["block_size"]
    tokens = (-(-(preset["input_len"] + preset["output_len"]) // block) + 1) * block
    return (preset["pools"][pool]["fits"] * tokens + block) * per_token_bytes(SHAPES[preset["shape"]])


def prepare(carry: Path) -> Path:
    """The default model's tokenizer, xz-compressed (3.5 MB -> 0.45 MB), and its config (the tiny models of
    ``cuda_engine.py`` take their vocabulary and special tokens from it), in the folder that is carried."""
    from kvpolicy.offline.model import prepare as prepare_default_model

    source = prepare_default_model()
    target = carry / "tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    (target / "tokenizer.json.xz").write_bytes(lzma.compress((source / "tokenizer.json").read_bytes()))
    for name in ("tokenizer_config.json", "config.json"):
        (target / name).write_bytes((source / name).read_bytes())
    return target


def unpack_tokenizer(carried: Path, folder: Path) -> Path:
    """The carried tokenizer and config as a model folder's files (without weights), in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(lzma.decompress((carried / "tokenizer.json.xz").read_bytes()))
    for name in ("tokenizer_config.json", "config.json"):
        if (carried / name).is_file():
            (folder / name).write_bytes((carried / name).read_bytes())
    return folder


def model_folder(shape_name: str, carry: Path) -> Path:
    """A model folder of ``shape_name``: its config.json and the carried tokenizer (prepared here if missing)."""
    tokenizer = carry / "tokenizer"
    if not (tokenizer / "tokenizer.json.xz").is_file():
        tokenizer = prepare(carry)
    folder = unpack_tokenizer(tokenizer, MODELS_DIR / shape_name)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape_name], indent=1))
    return folder


def bench_args(preset: dict, config: dict, pool: str, model: Path, output_json: Path, on_cuda: bool) -> list[str]:
    """The `vllm bench throughput` arguments of one row."""
    budget = str(preset["budget"])
    args = [
        "--model",
        str(model),
        "--load-format",
        "dummy",
        "--dataset-name",
        "random",
        "--random-input-len",
        str(preset["input_len"]),
        "--random-output-len",
        str(preset["output_len"]),
        "--num-prompts",
        str(preset["pools"][pool]["prompts"]),
        "--disable-detokenize",
        "--seed",
        "0",
        # A few tokens of slack: the random dataset re-encodes its text and may miss the length by one or two.
        "--max-model-len",
        str(preset["input_len"] + preset["output_len"] + 128),
        "--kv-cache-memory-bytes",
        str(pool_bytes(preset, pool)),
        "--output-json",
        str(output_json),
        *preset["engine_args"],
    ]
    max_num_seqs = preset["pools"][pool].get("max_num_seqs")
    if max_num_seqs:  # after the preset's own: the last one counts
        args += ["--max-num-seqs", str(max_num_seqs)]
    for arg in config["args"]:
        if arg == "{omnikv_args}":  # the preset's OmniKV layers, for a model the default ones do not fit
            args += preset.get("omnikv_args", [])
        else:
            args.append(arg.format(budget=budget, offload_gib=preset.get("offload_gib")))
    return args + WINDOW_ARGS + config.get("cuda_args" if on_cuda else "cpu_args", [])


def row_env(preset: dict, config: dict, on_cuda: bool) -> dict:
    """The environment a row's process adds: the preset's, the config's, and the config's for this platform."""
    return {**preset["env"], **config.get("env", {}), **config.get("cuda_env" if on_cuda else "cpu_env", {})}


def watch_worker(worker) -> str:
    """Sent to each worker after the warm-up (``LLM.collective_rpc``): from then on, count its steps by the CUDA
    graph mode vLLM ran them in (the last one its dispatcher chose in the step: FULL, PIECEWISE, or NONE), the
    Triton kernels it compiles (``triton.knobs.runtime.jit_post_compile_hook``, chained to vLLM's JIT monitor),
    and, on CUDA, every host synchronisation any code of the process makes (torch's sync debug mode, each
    warning counted where it was raised instead of printed). ``read_watch`` reads them."""
    import warnings
    from collections import Counter

    import torch

    worker = getattr(worker, "worker", worker)
    runner = worker.model_runner
    seen = {"steps": Counter(), "compiled": Counter(), "syncs": Counter(), "mode": "NONE"}
    seen["fixed"] = fixed_decode_steps(worker)
    worker.sweep_watch = seen
    run_step = runner.execute_model

    def step(*args, **kwargs):
        seen["mode"] = "NONE"
        try:
            return run_step(*args, **kwargs)
        finally:
            seen["steps"][seen["mode"]] += 1

    runner.execute_model = step
    v1, v2 = getattr(runner, "cudagraph_dispatcher", None), getattr(runner, "cudagraph_manager", None)
    if v1 is not None:
        dispatch_v1 = v1.dispatch

        def dispatched_v1(*args, **kwargs):
            mode, descriptor = dispatch_v1(*args, **kwargs)
            seen["mode"] = mode.name
            return mode, descriptor

        v1.dispatch = dispatched_v1
    elif v2 is not None:
        dispatch_v2 = v2.dispatch

        def dispatched_v2(*args, **kwargs):
            descriptor = dispatch_v2(*args, **kwargs)
            seen["mode"] = descriptor.cg_mode.name
            return descriptor

        v2.dispatch = dispatched_v2
    try:
        from triton import knobs

        chained = knobs.runtime.jit_post_compile_hook
    except (ImportError, AttributeError):  # no Triton, or a Triton without the hook
        seen["compiled"]["(not watched: no Triton post-compile hook)"] = 0
    else:

        def compiled(**kwargs):
            seen["compiled"][getattr(kwargs.get("fn"), "name", "?")] += 1
            return chained(**kwargs) if chained is not None else None

        knobs.runtime.jit_post_compile_hook = compiled
    if torch.cuda.is_available():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message).lower():
                seen["syncs"][f"{filename.rsplit('/', 2)[-1] if filename else '?'}:{lineno}"] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=".*[Ss]ynchroniz")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
    return "cuda" if torch.cuda.is_available() else "cpu"


def read_watch(worker) -> dict:
    """What ``watch_worker`` counted in a worker since, and its decode steps built in the fixed shapes of full CUDA
    graphs by padded batch size (None: the policy's decode does not run in them, or no kvpolicy)."""
    import torch

    worker = getattr(worker, "worker", worker)
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")
    seen = worker.sweep_watch
    fixed, before = fixed_decode_steps(worker), seen["fixed"] or {}
    return {
        "graph_steps": dict(seen["steps"]),
        "triton_compiles": dict(seen["compiled"]),
        "host_syncs": dict(seen["syncs"]) if torch.cuda.is_available() else NO_DEVICE,
        "fixed_decode_steps": None if fixed is None else {rows: n - before.get(rows, 0) for rows, n in fixed.items()},
    }


def fixed_decode_steps(worker) -> dict | None:
    """A worker's decode steps built in the fixed shapes of full CUDA graphs so far, by padded batch size (None:
    the policy's decode does not run in them, or no kvpolicy)."""
    fixed = getattr(getattr(getattr(worker, "kvpolicy", None), "mode", None), "fixed", None)
    return None if fixed is None else {int(rows): count for rows, count in fixed.steps.items()}


class RunningSampler(threading.Thread):
    """Samples ``vllm:num_requests_running`` every ``SAMPLE_EVERY_S`` while the timed run goes on, and the longest
    time requests ran without an output token (``stall_s``: a step that compiled, profiled or waited)."""

    def __init__(self, llm):
        super().__init__(daemon=True)
        self.llm, self.samples, self.read_s, self.done = llm, [], 0.0, threading.Event()
        self.stall_s, self._tokens, self._since = 0.0, None, None

    def run(self) -> None:
        while not self.done.wait(SAMPLE_EVERY_S):
            start = time.perf_counter()
            metrics = self.llm.get_metrics()
            running, tokens = (metric_total(metrics, name) for name in ("vllm:num_requests_running", GENERATED))
            self.samples.append(running)
            if tokens != self._tokens or not running:
                self._tokens, self._since = tokens, start
            self.stall_s = max(self.stall_s, start - self._since)
            self.read_s += time.perf_counter() - start


class Probe:
    """What vLLM's bench does not report, read from the ``LLM`` it builds (see the module docstring)."""

    COUNTERS = (
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:kvpolicy_relocated_requests",
        "vllm:kvpolicy_compressed_requests",
        "vllm:kvpolicy_released_blocks",
        "vllm:kvpolicy_prompt_kv_tokens",
        "vllm:kvpolicy_kept_kv_tokens",
        "vllm:kvpolicy_offloaded_requests",
        "vllm:kvpolicy_loaded_kv_pages",
    )

    #: Each request's time between two output tokens (vLLM's own histogram).
    INTER_TOKEN = "vllm:inter_token_latency_seconds"

    def __init__(self, input_len: int, started: float, warmup: dict):
        self.input_len, self.llm, self.sampler, self.before = input_len, None, None, {}
        self.warmup = warmup
        self.warmup_s, self.started, self.engine_start_s = 0.0, started, None
        self.watching = None
        self.inter_token_before = (0, 0.0)

    def attach(self, llm) -> None:
        import numpy as np
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm = llm
        # From this process's start to the engine built: imports, weights, compilation, graph capture.
        self.engine_start_s = time.perf_counter() - self.started
        vocab = llm.get_tokenizer().vocab_size
        rng = np.random.default_rng(1)
        prompts = [
            TokensPrompt(prompt_token_ids=rng.integers(100, vocab, self.input_len).tolist())
            for _ in range(self.warmup["prompts"])
        ]
        start = time.perf_counter()
        llm.generate(
            prompts,
            SamplingParams(max_tokens=self.warmup["output_len"], ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        self.warmup_s = time.perf_counter() - start
        try:
            self.watching = llm.collective_rpc(watch_worker)
        except Exception as error:  # the row's throughput is still worth its run; check() flags the missing fields
            self.watching = f"not watched: {error!r}"
        metrics = llm.get_metrics()
        self.before = {name: metric_total(metrics, name) for name in self.COUNTERS}
        self.inter_token_before = self._inter_token(metrics)
        self.sampler = RunningSampler(llm)
        self.sampler.start()

    def _inter_token(self, metrics) -> tuple[int, float]:
        """(count, sum) of the inter-token latency histogram, over its label sets."""
        found = [m for m in metrics if m.name == self.INTER_TOKEN]
        return sum(m.count for m in found), sum(m.sum for m in found)

    def result(self) -> dict:
        import torch

        self.sampler.done.set()
        self.sampler.join()
        metrics = self.llm.get_metrics()
        delta = {name.removeprefix("vllm:"): metric_total(metrics, name) - self.before[name] for name in self.COUNTERS}
        config = self.llm.llm_engine.vllm_config
        # Every request is submitted at once, so none runs only before the first step and after the last.
        samples = [n for n in self.sampler.samples if n] or [0.0]
        count, total = (now - before for now, before in zip(self._inter_token(metrics), self.inter_token_before))
        try:
            watched = self.llm.collective_rpc(read_watch)[0]
        except Exception as error:  # a report of the run, not a reason to lose it
            watched = {"error": f"not read: {error!r}"}
        return {
            "step_ms": 1000 * total / count if count else None,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "warmup_s": round(self.warmup_s, 2),
            "peak_running": int(max(samples)),
            "mean_running": statistics.fmean(samples),
            "running_samples": len(self.sampler.samples),
            "sample_read_ms": 1000 * self.sampler.read_s / max(len(self.sampler.samples), 1),
            "counters": delta,
            "pool_empty_after": metric_total(metrics, "vllm:kv_cache_usage_perc") == 0.0,
            "stall_s": round(self.sampler.stall_s, 2),
            "engine_start_s": round(self.engine_start_s, 1),
            "watched_on": self.watching,
            **watched,
            "engine": {
                "block_size": config.cache_config.block_size,
                "num_gpu_blocks": config.cache_config.num_gpu_blocks,
                "async_scheduling": config.scheduler_config.async_scheduling,
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "use_v2_model_runner": config.use_v2_model_runner,
                "attention_backend": str(config.attention_config.backend),
                "compilation_mode": str(config.compilation_config.mode),
                "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
                "enforce_eager": config.model_config.enforce_eager,
                "prefix_caching": config.cache_config.enable_prefix_caching,
            },
        }


def bench_one(
    probe_out: Path, input_len: int, warmup: dict, vllm_args: list[str], cpu_ops: str | None, on_cpu: bool
) -> None:
    """`vllm bench throughput` in this process through vLLM's own CLI, with the probe on the LLM it builds. On CPU
    (the engine core runs in this process): vLLM's asynchronous scheduler kept when asked for (its CPU platform
    turns it off), and kvpolicy's ``cpu_ops`` as the engine tests run them."""
    if on_cpu:
        from tests.e2e.engine_run import keep_async_scheduling_on_cpu, run_the_gpu_ops_on_cpu

        if "--async-scheduling" in vllm_args:
            keep_async_scheduling_on_cpu()
        if cpu_ops:
            run_the_gpu_ops_on_cpu(fixed_decode=cpu_ops == "fixed")
    from vllm import LLM
    from vllm.entrypoints.cli.main import main as vllm_main

    probe = Probe(input_len, STARTED, warmup)
    build = LLM.from_engine_args.__func__

    def built(cls, engine_args):
        llm = build(cls, engine_args)
        probe.attach(llm)
        return llm

    LLM.from_engine_args = classmethod(built)
    sys.argv = ["vllm", "bench", "throughput", *vllm_args]
    vllm_main()
    probe_out.write_text(json.dumps(probe.result(), indent=1))


def stop_group(proc: subprocess.Popen) -> None:
    """End a row's process group (its engine core and workers too): TERM, then KILL after 15 s."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass


def run_row(name: str, pool: str, preset: dict, model: Path, work: Path, timeout_s: float, on_cuda: bool) -> dict:
    """One row in its own process group, so a timeout ends its engine processes too."""
    config = CONFIGS[name]
    tag = f"{name}.{pool}"
    output_json, probe_json, log = work / f"{tag}.bench.json", work / f"{tag}.probe.json", work / f"{tag}.log"
    for path in (output_json, probe_json):
        path.unlink(missing_ok=True)
    args = bench_args(preset, config, pool, model, output_json, on_cuda)
    cmd = [
        sys.executable,
        __file__,
        "bench-one",
        "--probe-out",
        str(probe_json),
        "--input-len",
        str(preset["input_len"]),
        "--warmup",
        json.dumps(preset.get("warmup", WARMUP)),
        *([] if on_cuda else ["--on-cpu", *(["--cpu-ops", config["cpu_ops"]] if "cpu_ops" in config else [])]),
        "--",
        *args,
    ]
    diagnosed = (name, pool) in DIAGNOSED
    row = {
        "config": name,
        "pool": pool,
        "pool_mib": round(pool_bytes(preset, pool) / 2**20, 1),
        "fits": preset["pools"][pool]["fits"],
        "prompts": preset["pools"][pool]["prompts"],
        "args": args,
        "env": row_env(preset, config, on_cuda),
    }
    if diagnosed:
        row["env"][DIAGNOSE_ENV] = str(work / f"{tag}.diagnose")
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **row["env"]}, start_new_session=True
        )
        previous = signal.signal(signal.SIGTERM, lambda *_: (stop_group(proc), sys.exit(143)))
        try:
            proc.wait(timeout_s)
            row["status"] = "ok" if proc.returncode == 0 else f"rc={proc.returncode}"
        except subprocess.TimeoutExpired:
            stop_group(proc)
            row["status"] = f"timeout {timeout_s:.0f}s"
        finally:
            signal.signal(signal.SIGTERM, previous)
    row["engine_s"] = round(time.perf_counter() - start, 1)
    text = log.read_text(errors="replace")
    if match := THROUGHPUT_LINE.search(text):
        row["requests_s"], row["total_tok_s"], row["output_tok_s"] = map(float, match.groups())
    if output_json.is_file():
        row["bench_json"] = json.loads(output_json.read_text())
    if probe_json.is_file():
        probe = json.loads(probe_json.read_text())
        counters = probe["counters"]
        row |= {
            key: probe[key]
            for key in (
                "peak_running",
                "mean_running",
                "step_ms",
                "device",
                "warmup_s",
                "sample_read_ms",
                "pool_empty_after",
                "stall_s",
                "engine_start_s",
            )
        }
        row |= {"preemptions": int(counters["num_preemptions"]), "counters": counters, "engine": probe["engine"]}
        row |= watched_fields(probe)
        if counters["kvpolicy_loaded_kv_pages"] and counters["generation_tokens"]:
            shape = SHAPES[preset["shape"]]
            page_bytes = preset["block_size"] * 2 * shape["head_dim"] * DTYPE_BYTES[shape["torch_dtype"]]
            loaded = counters["kvpolicy_loaded_kv_pages"] * page_bytes
            row["h2d_bytes_per_output_token"] = loaded / counters["generation_tokens"]
        if CONFIGS[name]["args"][:1] == ["--kv-policy"]:
            row["released_blocks_per_request"] = counters["kvpolicy_released_blocks"] / row["prompts"]
            if counters["kvpolicy_prompt_kv_tokens"]:
                row["kept_fraction"] = counters["kvpolicy_kept_kv_tokens"] / counters["kvpolicy_prompt_kv_tokens"]
    if diagnosed:
        row |= read_diagnostics(work / f"{tag}.diagnose")
    facts = (line.strip() for line in text.splitlines() if len(line) < 400 and FACT_LINE.search(line))
    row["log_facts"] = list(dict.fromkeys(facts))[:30]
    if row["status"] != "ok":
        row["error_tail"] = text[-3000:]
    return row


def watched_fields(probe: dict) -> dict:
    """The window's per-row facts from a probe (``watch_worker``): the scheduler, the timed run's steps by CUDA
    graph mode, its fixed-shape decode steps, the Triton kernels compiled and the host synchronisations after the
    warm-up (on CUDA; None on CPU, where there is no device to wait for), each with its details."""
    if "graph_steps" not in probe:
        return {"watch_error": probe.get("error")}
    steps, syncs = probe["graph_steps"], probe["host_syncs"]
    fixed = probe["fixed_decode_steps"]
    return {
        "async": probe["engine"]["async_scheduling"],
        "full_graph_steps": steps.get("FULL", 0),
        "piecewise_steps": steps.get("PIECEWISE", 0),
        "eager_steps": steps.get("NONE", 0),
        "fixed_steps": "none: no kvpolicy fixed-shape buffers" if fixed is None else sum(fixed.values()),
        "triton_compiles": sum(probe["triton_compiles"].values()),
        "host_syncs": syncs if isinstance(syncs, str) else sum(syncs.values()),
        "watched": {
            key: probe[key]
            for key in ("watched_on", "graph_steps", "triton_compiles", "host_syncs", "fixed_decode_steps")
        },  # fmt: skip
    }


def read_diagnostics(folder: Path) -> dict:
    """A diagnosed row's host synchronisations inside kvpolicy's calls (every worker's, added up) and each
    worker's profile summary (``kvpolicy/vllm/worker/diagnostics.py``)."""
    syncs = [json.loads(p.read_text()) for p in sorted(folder.glob("syncs-*.json"))]
    profiles = [json.loads(p.read_text()) for p in sorted(folder.glob("profile-*.json"))]
    found = {}
    if syncs:
        found["syncs"] = sum(s["syncs"] for s in syncs)
        found["sync_places"] = [dict(s["by_place"]) for s in syncs]
        found["kvpolicy_calls"] = sum(s["calls"] for s in syncs)
    if profiles:
        found["profile"] = profiles
    return found


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's output tokens/s over each baseline's on the same pool (when that baseline has run)."""
    speed = {(r["config"], r["pool"]): r.get("output_tok_s") for r in rows}
    out = []
    for row in rows:
        row = dict(row)
        for column, baseline in BASELINES.items():
            base = speed.get((baseline, row["pool"]))
            row[column] = row["output_tok_s"] / base if base and row.get("output_tok_s") else None
        out.append(row)
    return out


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["runs"] if r.get("output_tok_s")]
    pools = [p for p in payload["settings"]["pools"] if any(r["pool"] == p for r in rows)]
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(len(configs), 1)
    for k, name in enumerate(configs):
        by_pool = {r["pool"]: r for r in rows if r["config"] == name}
        xs = [i + (k - (len(configs) - 1) / 2) * width for i in range(len(pools))]
        for ax, key in zip(axes, ("output_tok_s", "peak_running")):
            ax.bar(xs, [by_pool.get(p, {}).get(key) or 0 for p in pools], width, label=name)
    settings = payload["settings"]
    for ax, label in zip(axes, ("output tokens/s (vllm bench throughput)", "peak running requests")):
        ax.set_xticks(range(len(pools)), [f"{p}\n({settings['pools'][p]['fits']} requests fit)" for p in pools])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{settings['shape']}, {settings['input_len']} in / {settings['output_len']} out, "
        f"budget {settings['budget']} - {payload.get('device', '?')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(payload: dict, out: Path) -> str:
    """The markdown table (with the platform note) and the plot beside ``out``; returns the table."""
    table = markdown_table(with_ratios(payload["runs"]), COLUMNS)
    note = payload["settings"].get("platform_note")
    out.with_suffix(".md").write_text((f"{note}\n\n" if note else "") + table + "\n")
    if any(r.get("output_tok_s") for r in payload["runs"]):
        plot(payload, out.with_suffix(".png"))
    return table


def run(args) -> None:
    from tqdm import tqdm

    deadline = time.monotonic() + args.deadline_s
    preset_name = (
        f"{args.preset}-tiny" if args.tiny and args.preset != "gpu" else ("tiny" if args.tiny else args.preset)
    )
    preset = PRESETS[preset_name]
    on_cuda = _on_cuda()
    model = model_folder(preset["shape"], args.carry)
    work = args.work or args.out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    settings = {
        **preset,
        "preset": preset_name,
        "configs": CONFIGS,
        "order": ORDER,
        "warmup": preset.get("warmup", WARMUP),
        "kv_bytes_per_token": per_token_bytes(SHAPES[preset["shape"]]),
        "model_config": SHAPES[preset["shape"]],
        "platform": "cuda" if on_cuda else "cpu",
    }
    if not on_cuda:
        settings["platform_note"] = (
            "CPU rehearsal: vLLM's CPU platform has one attention backend, no V2 model runner and no CUDA graphs, so "
            "`vllm-default`, `vllm-v1` and `vllm-triton-v1` run one engine here (its asynchronous scheduler kept, as "
            "on CUDA), and kvpolicy's rows run its Triton ops in Triton's interpreter (fixed-shape decode for the "
            "relocating policies). Tokens/s of a random-weight 2-layer model on a shared 2-core CPU say nothing "
            "about speed."
        )
    payload = {**provenance(sys.argv), "device": None, "settings": settings, "runs": []}
    if args.resume and args.out.is_file():
        payload["runs"] = [r for r in json.loads(args.out.read_text())["runs"] if r.get("status") == "ok"]
    done = {(r["config"], r["pool"]) for r in payload["runs"]}
    rows = preset.get("order", ORDER)
    order = [(c, p) for c, p in rows if (c, p) not in done and (not args.only or f"{c}.{p}" in args.only)]
    failed: dict[str, str] = {}  # config -> the pool its row failed on: its later rows do not start
    for name, pool in tqdm(order, desc="rows", unit="engine"):
        left = deadline - time.monotonic()
        skip = f"not started: {name} failed on {failed[name]}" if name in failed else None
        if left < preset["min_run_s"]:
            skip = f"not started: {left:.0f} s left"
        if skip:
            payload["runs"].append({"config": name, "pool": pool, "status": skip})
            write_json(args.out, payload)
            write_report(payload, args.out)
            continue
        row = run_row(name, pool, preset, model, work, min(preset["run_timeout_s"], left), on_cuda)
        payload["device"] = payload["device"] or row.get("device")
        payload["runs"].append(row)
        if row["status"] != "ok":
            failed[name] = pool
        write_json(args.out, payload)
        write_report(payload, args.out)
        tqdm.write(
            f"{name:17s} {pool:6s} {row['status']:12s} {row['engine_s']:6.1f}s  "
            f"out {row.get('output_tok_s', '-')} tok/s  peak running {row.get('peak_running', '-')}  "
            f"preemptions {row.get('preemptions', '-')}"
        )
    print(write_report(payload, args.out))
    print(f"\nwrote {args.out} and its .md, .png")


#: What every row of a window records (the issue's list): a rehearsal whose rows miss one fails ``check``.
WINDOW_FIELDS = (
    "output_tok_s",
    "async",
    "full_graph_steps",
    "piecewise_steps",
    "eager_steps",
    "triton_compiles",
    "host_syncs",
    "fixed_steps",
    "preemptions",
    "mean_running",
    "stall_s",
    "engine_start_s",
)


def check(paths: list[Path]) -> int:
    """Every row of each results file finished and filled ``WINDOW_FIELDS`` (a ``cuda_engine.py`` run's: every
    engine exited 0); prints what is missing."""
    missing = []
    for path in paths:
        if not path.is_file():
            missing.append(f"{path}: not written")
            continue
        payload = json.loads(path.read_text())
        for name, engine in payload.get("configs", {}).items():
            if engine["rc"] != 0:
                missing.append(f"{path.name}: {name}: rc {engine['rc']}")
        for row in payload.get("runs", []):
            absent = [key for key in WINDOW_FIELDS if row.get(key) is None]
            if row.get("status") != "ok" or absent:
                missing.append(
                    f"{path.name}: {row['config']}.{row['pool']}: status {row.get('status')}, missing {absent}"
                )
    print("\n".join(missing) or f"every row of {', '.join(p.name for p in paths)} filled {', '.join(WINDOW_FIELDS)}")
    return 1 if missing else 0


def _on_cuda() -> bool:
    """Whether vLLM will run on CUDA, without starting CUDA in this process (the rows need all its memory)."""
    import shutil

    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True, check=False).returncode == 0
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="put the tokenizer that travels in the carried folder")
    prep.add_argument("--carry", type=Path, default=CARRY_DIR)
    sweep = sub.add_parser("run", help="the sweep")
    sweep.add_argument("--tiny", action="store_true", help="the CPU rehearsal preset")
    sweep.add_argument(
        "--preset", choices=("gpu", "offload"), default="gpu", help="offload: OmniKV's host tier at 32K tokens"
    )
    sweep.add_argument("--out", type=Path, default=None, help="results JSON (.md and .png beside it)")
    sweep.add_argument("--work", type=Path, default=None, help="per-row logs and bench JSONs (default: beside --out)")
    sweep.add_argument("--carry", type=Path, default=CARRY_DIR)
    sweep.add_argument("--deadline-s", type=float, default=3600, help="start no row after this many seconds")
    sweep.add_argument("--resume", action="store_true", help="keep the rows --out already holds and skip them")
    sweep.add_argument("--only", nargs="+", default=None, help="rows to run, as config.pool")
    report = sub.add_parser("report", help="the table and plot again from a results JSON")
    report.add_argument("json", type=Path)
    checked = sub.add_parser("check", help="whether every row of results JSONs finished and filled the window's fields")
    checked.add_argument("json", type=Path, nargs="+")
    one = sub.add_parser("bench-one", help=argparse.SUPPRESS)
    one.add_argument("--probe-out", type=Path, required=True)
    one.add_argument("--input-len", type=int, required=True)
    one.add_argument("--warmup", type=json.loads, default=WARMUP)
    one.add_argument("--on-cpu", action="store_true")
    one.add_argument("--cpu-ops", choices=("triton", "fixed"), default=None)
    one.add_argument("vllm_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.command == "prepare":
        print(prepare(args.carry))
    elif args.command == "run":
        names = {
            "gpu": ("gpu_throughput", "gpu_rehearsal_cpu"),
            "offload": ("gpu_offload", "gpu_offload_rehearsal_cpu"),
        }
        args.out = args.out or RESULTS_DIR / f"{names[args.preset][args.tiny]}.json"
        run(args)
    elif args.command == "report":
        print(write_report(json.loads(args.json.read_text()), args.json))
    elif args.command == "check":
        raise SystemExit(check(args.json))
    else:
        vllm_args = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
        bench_one(args.probe_out, args.input_len, args.warmup, vllm_args, args.cpu_ops, args.on_cpu)


if __name__ == "__main__":
    main()
