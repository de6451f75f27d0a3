"""Run the real vLLM engine once on a fixed mixed batch and dump tokens and logprobs as JSON.

    python tests/e2e/engine_run.py --policy identity --out out.json
    python tests/e2e/engine_run.py --stock --out stock.json   # vLLM without kvpolicy
    python tests/e2e/engine_run.py --policy adasnap --budget 128 --capture --out a.json

Prompts of different lengths read in chunks while short ones decode, token ids in, token ids and logprobs out (no
tokenizer); ``--capture`` also saves what the policy saw and chose for the longest prompt at a few layers
(``<out>.captured.pt``) for the reference tests. Deterministic on purpose, so runs compare bit for bit: the engine
core in this process, on one OpenMP thread; why: docs/benchmarks.md#how-engine-runs-stay-deterministic-and-cheap.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

PROMPT_LENS = (40, 300, 700, 1100, 129, 256)
MAX_TOKENS = 24
LOGPROBS = 5
CAPTURED_LAYERS = (0, 15, 29)


class CapturingPolicy:
    """The engine's policy, unchanged, plus a record of its inputs and kept indices for the longest prompt. A
    policy that observes every layer first (``observes_every_layer``) sees a layer's queries when it observes
    it and compresses it after the last layer: its inputs are those it observed."""

    def __init__(self, policy):
        self.policy = policy
        self.records: dict[int, dict] = {}
        self.observed: dict[int, object] = {}

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def observe(self, prompt, budget):
        if prompt.num_tokens == max(PROMPT_LENS):
            self.observed[prompt.layer] = prompt
        return self.policy.observe(prompt, budget)

    def keep(self, prompt, budget):
        kept = self.policy.keep(prompt, budget)
        self._record(prompt, budget, kept)
        return kept

    def compress(self, prompt, budget, observation=None):
        result = self.policy.compress(prompt, budget, observation)
        self._record(prompt, budget, result.kept)
        return result

    def _record(self, prompt, budget, kept):
        if prompt.num_tokens == max(PROMPT_LENS) and prompt.layer in CAPTURED_LAYERS:
            inputs = self.observed.get(prompt.layer, prompt)
            seen = {name: getattr(inputs, name) for name in ("window_queries", "column_sums")}
            self.records.setdefault(
                prompt.layer,
                {
                    "keys": prompt.keys.clone(),
                    **{k: v.clone() for k, v in seen.items() if v is not None},
                    "num_layers": prompt.num_layers,
                    "budget": budget,
                    "kept": [k.clone() for k in kept],
                },
            )


class SharedAttentionRecords:
    """PoD: every per-head attention of the first decode step of the first laid-out row, by (layer, head)."""

    def __init__(self):
        self.records: dict[tuple[int, int], dict] = {}
        self.layer = None
        self.step_done = False


def capture_shared_attention() -> SharedAttentionRecords:
    """Wrap the sharing path so that each per-head attention of the first row is recorded with its inputs
    (the query, and the keys and values it read, gathered again from its pages) and its output."""
    import torch

    from kvpolicy.vllm.worker.modes import share as sharing

    capture = SharedAttentionRecords()
    attend_layer = sharing.SharingPath._attend_shared

    def recording_layer(self, layer, layer_idx, query, out, shared):
        attend_layer(self, layer, layer_idx, query, out, shared)
        if capture.step_done:
            return
        pages, request, tables = self.worker.page_space().pages, shared.requests[0], shared.tables.layer(layer_idx)
        heads = len(shared.rows.head_of) // len(shared.requests)
        group = query.shape[1] // heads
        token = int(shared.token_idx[0])
        for head, slots in enumerate(request.main_slots(layer_idx)):
            keys, values = self.ops.gather(layer, pages, slots)
            rows = slice(head * group, (head + 1) * group)
            record = {"query": query[token, rows].clone(), "keys": keys, "values": values, "scale": layer.impl.scale}
            source = int(tables.read_from[head])
            if source >= 0:
                even, odd = self.ops.gather(layer, pages, request.value_slots(layer_idx, head))  # values 2j, 2j + 1
                record["distant_logits"] = shared.distant_logits[source, :, : request.num_distant].clone()
                record["distant_values"] = torch.stack([even, odd], dim=1).flatten(0, 1)[: request.num_distant]
            else:
                record["distant_logits"] = record["distant_values"] = None
            record.update(out=out[token, rows].clone(), distant=request.distant)
            capture.records[layer_idx, head] = record
        capture.step_done = layer_idx == len(self._lowest) - 1

    sharing.SharingPath._attend_shared = recording_layer
    return capture


def _kvpolicy_state(worker):
    return getattr(worker, "worker", worker).kvpolicy


def worker_state(llm):
    """The worker's kvpolicy state: the engine core runs in this process, so the worker's own object."""
    return llm.collective_rpc(_kvpolicy_state)[0]


def run_the_gpu_ops_on_cpu(fixed_decode: bool) -> None:
    """The CPU backend on kvpolicy's Triton ops (in Triton's interpreter) instead of its CPU ops, refusing the
    layers they cannot serve as a GPU does; ``fixed_decode``: decode steps in the fixed shapes of a GPU's full
    CUDA graphs. For this process's engine (the worker runs in it), before it starts."""
    from kvpolicy.vllm.worker import cpu_backend
    from kvpolicy.vllm.worker.ops.triton import TritonOps

    builder, impl = cpu_backend.KVPolicyCPUMetadataBuilder, cpu_backend.KVPolicyCPUImpl
    builder.make_ops = lambda self: TritonOps()
    if fixed_decode:
        builder.fixed_decode_rows = lambda self: self.vllm_config.scheduler_config.max_num_seqs
    make_impl = impl.__init__

    def checked_impl(self, *args, **kwargs):
        make_impl(self, *args, **kwargs)
        TritonOps.check_impl(self)

    impl.__init__ = checked_impl


def _ops_name(worker):
    return _kvpolicy_state(worker).ops


def _fixed_decode(worker):
    """The fixed-shape decode steps by padded size, and the byte ranges of their buffers (None: not on)."""
    fixed = getattr(_kvpolicy_state(worker).mode, "fixed", None)
    if fixed is None:
        return None
    ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in fixed.buffers()]
    return dict(fixed.steps), ranges


#: Kernel arguments that are the model's activations: a CUDA graph keeps them at addresses of its own.
ACTIVATIONS = ("query_ptr", "out_ptr", "key_ptr", "value_ptr")


def launch_arguments(kernel, args: tuple, grid) -> tuple:
    """A launch as a graph would replay it: the grid, and each argument but the activations (tensors by
    address)."""
    names = inspect.signature(kernel.fn).parameters
    return (
        kernel.fn.__name__,
        tuple(grid),
        tuple(
            (name, value.data_ptr() if hasattr(value, "data_ptr") else value)
            for name, value in zip(names, args)
            if name not in ACTIVATIONS
        ),
    )


def fixed_decode_launches(calls: list[tuple], ranges: list[tuple[int, int]]) -> dict[str, list[int]]:
    """Per kernel, of the launches that read a fixed-shape buffer: [launches, distinct argument lists]."""
    summary: dict[str, list[int]] = {}
    for name, grid, arguments in calls:
        pointers = [value for _, value in arguments if isinstance(value, int)]
        if any(start <= p < end for p in pointers for start, end in ranges):
            summary.setdefault(name, [0, set()])
            summary[name][0] += 1
            summary[name][1].add((grid, arguments))
    return {name: [count, len(distinct)] for name, (count, distinct) in summary.items()}


def prompts(lengths=PROMPT_LENS, vocab_size: int = 49152, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def generate_aborting(llm, token_lists, params, steps: int) -> list:
    """Step the engine ``steps`` times, abort the longest request, then run the others to the end:
    the outputs of the requests that finished, in submission order."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    for i, ids in enumerate(token_lists):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    longest = str(max(range(len(token_lists)), key=lambda i: len(token_lists[i])))
    finished, step = {}, 0
    while engine.has_unfinished_requests():
        if step == steps:
            engine.abort_request([longest])
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
    return [finished[key] for key in sorted(finished, key=int)]


def record_kernel_launches() -> dict:
    """What Triton compiles for each launch of kvpolicy's kernels (``kvpolicy_triton.specialization``), by
    phase: ``start`` until the engine is built, ``serve`` after (the caller switches ``phase``)."""
    import kvpolicy_triton

    launches = {"phase": "start", "start": set(), "serve": set(), "calls": []}
    for kernel in kvpolicy_triton.STEADY_KERNELS:

        def recording(*args, _kernel=kernel, _run=kernel.run, **kwargs):
            launch_kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            launches[launches["phase"]].add(kvpolicy_triton.specialization(_kernel, args, launch_kwargs))
            if launches["phase"] == "serve":
                launches["calls"].append(launch_arguments(_kernel, args, kwargs["grid"]))
            return _run(*args, **kwargs)

        kernel.run = recording
    return launches


def keep_async_scheduling_on_cpu() -> None:
    """vLLM's CPU platform turns its asynchronous scheduler off (``CpuPlatform.check_and_update_config``);
    its engine core, scheduler and model runner run it all the same, so the order it schedules steps in
    can be checked here."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_keeping_async(cls, vllm_config):
        wanted = vllm_config.scheduler_config.async_scheduling
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    CpuPlatform.check_and_update_config = classmethod(check_keeping_async)


def kv_token_bytes(num_layers: int, kv_heads: int, head_size: int, itemsize: int) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * kv_heads * head_size * itemsize


def roomy_pool_bytes(args) -> int:
    """A CPU pool that holds every request of the run at once twice over, and two of ``--max-model-len``: room
    to spare, as vLLM's 1 GiB default had for these models, without zeroing a GiB in every run (a third of a
    small model's run)."""
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    token_bytes = kv_token_bytes(config["num_hidden_layers"], kv_heads, head_size, itemsize=4)  # float32 runs
    run_tokens = sum(args.shared_prefix + n + args.max_tokens for n in args.prompt_lens)
    return 2 * max(run_tokens, args.max_model_len) * token_bytes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--policy", default=None)
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--pool-mib", type=int, default=None, help="KV pool size; small forces preemption")
    parser.add_argument("--stock", action="store_true", help="load no vLLM plugin at all")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--capture", action="store_true", help="save the policy's inputs and choices")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=PROMPT_LENS)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens")
    parser.add_argument("--filter-layers", default=None, help="omnikv: comma-separated filter layers")
    parser.add_argument("--dense-layers", type=int, default=None, help="omnikv: layers below it attend fully")
    parser.add_argument("--offload", type=float, default=None, help="omnikv: host pool GiB (--kv-offload)")
    parser.add_argument("--sink-tokens", type=int, default=None)
    parser.add_argument("--recent-tokens", type=int, default=None)
    parser.add_argument("--pod-groups", default=None, help="pod: a layer grouping JSON (--kv-pod-groups)")
    parser.add_argument("--pod-tau", type=float, default=None, help="pod: --kv-pod-tau")
    parser.add_argument("--pod-delta", type=float, default=None, help="pod: --kv-pod-delta")
    parser.add_argument(
        "--ops", choices=("cpu", "triton"), default=None, help="kvpolicy's ops (triton: interpreted on CPU)"
    )
    parser.add_argument(
        "--torch-paths",
        action="store_true",
        help="cpu ops: the paths kvpolicy takes where vLLM's ISA packs pages non-affinely (AMX)",
    )
    parser.add_argument("--abort-after", type=int, default=None, help="abort the longest request after this many steps")
    parser.add_argument("--prefix-caching", action="store_true", help="--enable-prefix-caching")
    parser.add_argument("--no-reserve-growth", action="store_true", help="--kv-reserve-growth false: vLLM's admission")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="--tensor-parallel-size, one core per rank")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="--pipeline-parallel-size, one core per stage")
    parser.add_argument("--kv-transfer-config", default=None, help="vLLM's --kv-transfer-config, as JSON")
    parser.add_argument("--tp-allocation", default=None, help="--kv-tp-allocation exact|rank")
    parser.add_argument("--page-pool", default=None, help="--kv-page-pool model|layer")
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="every prompt starts with the same this many tokens; the first runs alone, then the rest",
    )
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's --block-size (default: the platform's)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.5, help="CUDA: lower it to run engines side by side"
    )
    parser.add_argument("--attention-backend", default=None, help="vLLM's --attention-backend, by name")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="CUDA: let vLLM capture its graphs (no --enforce-eager)"
    )
    parser.add_argument("--async-scheduling", action="store_true", help="vLLM's asynchronous scheduler, on CPU too")
    parser.add_argument(
        "--fixed-decode", action="store_true", help="with --ops triton: decode in the fixed shapes of CUDA graphs"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.ops == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    if args.stock:
        os.environ["VLLM_PLUGINS"] = ""
    else:
        import kvpolicy.vllm  # noqa: F401  (LLM(kv_policy=...) needs the options registered)

        if args.torch_paths:
            from kvpolicy.vllm.worker.ops import cpu

            cpu.cpu_geometry = lambda layout, cache: None  # as for a layout the C++ ops cannot address
        if args.ops == "triton":
            run_the_gpu_ops_on_cpu(args.fixed_decode)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {} if args.stock else {"kv_policy": args.policy, "kv_budget": args.budget}
    if args.pool_mib:
        kwargs["kv_cache_memory_bytes"] = args.pool_mib << 20
    elif on_cpu:
        kwargs["kv_cache_memory_bytes"] = roomy_pool_bytes(args)
    if args.filter_layers:
        kwargs["kv_filter_layers"] = tuple(int(layer) for layer in args.filter_layers.split(","))
    if args.dense_layers is not None:
        kwargs["kv_dense_layers"] = args.dense_layers
    if args.offload:
        kwargs["kv_offload"] = args.offload
    if args.tensor_parallel > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel
    if args.pipeline_parallel > 1:
        kwargs["pipeline_parallel_size"] = args.pipeline_parallel
    ranks = args.tensor_parallel * args.pipeline_parallel
    if ranks > 1:  # a core per rank, over a test worker's own one (tests/conftest.py)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(ranks)))
    if args.kv_transfer_config:
        kwargs["kv_transfer_config"] = json.loads(args.kv_transfer_config)
    if args.tp_allocation:
        kwargs["kv_tp_allocation"] = args.tp_allocation
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.attention_backend:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        kwargs["attention_backend"] = AttentionBackendEnum[args.attention_backend]
    if args.no_reserve_growth:
        kwargs["kv_reserve_growth"] = False
    if args.async_scheduling:
        keep_async_scheduling_on_cpu()
        kwargs["async_scheduling"] = True
    for name in ("sink_tokens", "recent_tokens", "pod_groups", "pod_tau", "pod_delta", "page_pool"):
        if getattr(args, name) is not None:
            kwargs[f"kv_{name}"] = getattr(args, name)
    kernel_launches = record_kernel_launches() if args.ops == "triton" else None
    llm = LLM(
        args.model,
        dtype="float32",
        enforce_eager=not args.cuda_graphs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.chunk,
        enable_chunked_prefill=True,
        enable_prefix_caching=args.prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
        skip_tokenizer_init=True,  # token ids in and out: about 1 s of a run is loading the tokenizer
        disable_log_stats=False,
        **kwargs,
    )
    if kernel_launches is not None:
        kernel_launches["phase"] = "serve"  # the engine is built: vLLM's warm-up and kvpolicy's are done
    if args.capture:
        from kvpolicy.policies import Mode

        worker = worker_state(llm)
        if worker.policy.mode is Mode.SHARE:
            capturing = capture_shared_attention()
        else:
            worker.policy = capturing = CapturingPolicy(worker.policy)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=LOGPROBS, ignore_eos=True)
    if args.shared_prefix:
        shared = prompts([args.shared_prefix], seed=1)[0]
        first, *rest = [TokensPrompt(prompt_token_ids=shared + p) for p in prompts(args.prompt_lens)]
        outputs = [*llm.generate([first], params, use_tqdm=False), *llm.generate(rest, params, use_tqdm=False)]
    elif args.abort_after is None:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts(args.prompt_lens)], params, use_tqdm=False
        )
    else:
        outputs = generate_aborting(llm, prompts(args.prompt_lens), params, args.abort_after)
    result = [
        {
            "token_ids": list(o.outputs[0].token_ids),
            "cached_tokens": o.num_cached_tokens,
            "logprobs": [{str(tok): lp.logprob for tok, lp in step.items()} for step in o.outputs[0].logprobs],
        }
        for o in outputs
    ]
    metrics = llm.get_metrics()
    counters = {m.name.removeprefix("vllm:kvpolicy_"): m.value for m in metrics if m.name.startswith("vllm:kvpolicy_")}
    usage = [m.value for m in metrics if m.name == "vllm:kv_cache_usage_perc"]
    prefix_hits = sum(m.value for m in metrics if m.name == "vllm:prefix_cache_hits")
    preemptions = sum(m.value for m in metrics if m.name == "vllm:num_preemptions")
    config = llm.llm_engine.vllm_config
    model = config.model_config
    hf = model.hf_config
    token_bytes = kv_token_bytes(
        hf.num_hidden_layers, hf.num_key_value_heads, model.get_head_size(), model.dtype.itemsize
    )
    block_bytes = config.cache_config.block_size * token_bytes
    summary = {
        "ops": None if args.stock else llm.collective_rpc(_ops_name)[0],
        "kernel_variants": None
        if kernel_launches is None
        else {phase: sorted(map(repr, kernel_launches[phase])) for phase in ("start", "serve")},
        "counters": counters,
        "kv_cache_usage_end": usage[0] if usage else None,
        "preemptions": preemptions,
        "prefix_cache_hits": prefix_hits,
        "block_bytes": block_bytes,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
    }
    fixed = None if args.stock else llm.collective_rpc(_fixed_decode)[0]
    if fixed is not None:
        steps, ranges = fixed
        summary["fixed_decode_steps"] = steps
        if kernel_launches is not None:
            summary["fixed_decode_launches"] = fixed_decode_launches(kernel_launches["calls"], ranges)
    if args.capture:
        summary["captured"] = args.out + ".captured.pt"
        torch.save(capturing.records, summary["captured"])
    with open(args.out, "w") as f:
        json.dump({**summary, "requests": result}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
