"""Long-context decode speed and needle answers: full attention against OmniKV's sparse layers.

    python benchmarks/decode.py --quick   # contexts 4K and 7.6K, budget 1024 (and 256 tokens, for the bound)
    python benchmarks/decode.py --quick --no-offload --rounds 5   # each configuration timed 5 times, in rotation
    python benchmarks/decode.py           # contexts 2K, 4K and 7.6K, budgets 512 and 1024
    python benchmarks/decode.py --quick --filter-layers 2 --out benchmarks/results/decode_one_filter.json

Two engines decode four passkey prompts per context at batch 4 and 1, each configuration timed against the full cache
and OmniKV's bound from the same run; writes ``benchmarks/results/decode.json``, a table and a plot. Method and
columns: docs/benchmarks.md#decode-speed-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import ANSWER_QUESTION, RESULTS_DIR, metric_total, passkey_prompts, write_results  # noqa: E402

DEPTHS = [0.2, 0.4, 0.6, 0.8]
STEPS = 24
ANSWER_TOKENS = 12
MAX_MODEL_LEN = 8192
#: The full-cache context whose step stands for a step's cost outside attention (OmniKV's bound).
SHORT_CONTEXT = 256
#: The offload engine's host pool: four 8K requests reserve about 1.1 GiB.
HOST_GIB = 2.0
OFFLOAD = "omnikv --kv-offload"
#: Pages the sparse layers read, and the context pages they chose from (omnikv's counters).
PAGE_COUNTERS = ("vllm:kvpolicy_selected_pages", "vllm:kvpolicy_context_pages")
COLUMNS = [
    "policy",
    "budget",
    "context",
    "batch",
    "decode_tokens_per_s",
    "ms_per_token",
    "needle_correct",
    "same_answers",
    "pages_read",
    "blocks_held",
    "speedup",
    "bound",
    "of_bound",
]


def decode(llm, prompts: list[dict], budget: int, tag: str) -> tuple[list[dict], list[str]]:
    """Decode the prompts at ``budget`` (batch 4, then batch 1): timing rows and each request's answer."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(
        max_tokens=2 * STEPS + ANSWER_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_budget": budget}
    )
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for req_id, item in zip(ids, prompts):
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=item["ids"]), params)
    texts = dict.fromkeys(ids, "")
    lengths = dict.fromkeys(ids, 0)

    def step() -> float:
        start = time.perf_counter()
        for output in engine.step():
            texts[output.request_id] = output.outputs[0].text
            lengths[output.request_id] = len(output.outputs[0].token_ids)
        return time.perf_counter() - start

    while min(lengths.values()) < 1:
        step()
    rows = []
    num_blocks = engine.vllm_config.cache_config.num_gpu_blocks
    for batch in (len(ids), 1):
        before = [metric_total(llm.get_metrics(), name) for name in PAGE_COUNTERS]
        times = [step() for _ in range(STEPS)]
        metrics = llm.get_metrics()
        after = [metric_total(metrics, name) for name in PAGE_COUNTERS]
        selected, context = (a - b for a, b in zip(after, before))
        ms = 1000 * statistics.median(times)
        rows.append(
            {
                "batch": batch,
                "ms_per_token": ms,
                "decode_tokens_per_s": 1000 * batch / ms,
                "pages_read": selected / context if context else 1.0,
                "blocks_held": round(metric_total(metrics, "vllm:kv_cache_usage_perc") * num_blocks),
            }
        )
        if batch > 1:
            while min(lengths.values()) < ANSWER_TOKENS:
                step()
            engine.abort_request(ids[1:])
    engine.abort_request(ids[:1])
    while engine.has_unfinished_requests():
        step()
    return rows, [texts[i] for i in ids]


def first_answers(tokenizer, texts: list[str]) -> list[str]:
    """Each request's first ANSWER_TOKENS tokens, as text."""
    return [tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:ANSWER_TOKENS]) for text in texts]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))

    def label(row: dict) -> str:
        return row["policy"] + (f"@{row['budget']}" if row["budget"] else "")

    for ax, batch in zip(axes, sorted({r["batch"] for r in rows})):
        for name in dict.fromkeys(map(label, rows)):
            subset = [r for r in rows if r["batch"] == batch and label(r) == name]
            ax.plot([r["context"] for r in subset], [r["decode_tokens_per_s"] for r in subset], marker="o", label=name)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.legend(fontsize=8)
    fig.suptitle("OmniKV decode speed vs the full cache (SmolLM2-135M, vLLM CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_engine(args) -> dict:
    """One engine, in this process: the rows of every (context, budget) it serves, and its settings."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # steps timed here, not across a process boundary
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    from tqdm import tqdm
    from vllm import LLM

    import kvpolicy.vllm  # noqa: F401
    from kvpolicy.config import KVPolicyConfig
    from kvpolicy.offline.model import prepare

    offload = args.engine == "offload"
    llm = LLM(
        str(prepare()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=not offload,
        kv_cache_memory_bytes=4 << 30,
        max_num_seqs=len(DEPTHS),
        seed=0,
        disable_log_stats=False,
        kv_policy="omnikv",
        kv_budget=max(args.budgets),
        **({"kv_offload": HOST_GIB} if offload else {}),
        **({"kv_filter_layers": tuple(map(int, args.filter_layers.split(",")))} if args.filter_layers else {}),
    )
    tokenizer = llm.get_tokenizer()
    rows = []
    budgets = [max(args.budgets)] if offload else [None, *args.budgets]
    grid = [(context, budget) for context in args.contexts for budget in budgets]
    if not offload and SHORT_CONTEXT not in args.contexts:
        grid.insert(0, (SHORT_CONTEXT, None))
    rounds = 1 if offload else args.rounds
    prompts = {context: passkey_prompts(tokenizer, DEPTHS, context, ANSWER_QUESTION) for context, _ in grid}
    timings: dict[tuple[int, int | None], list[list[dict]]] = {config: [] for config in grid}
    answers = {}  # each configuration's answers, from its first round
    for round_index, (context, budget) in enumerate(
        tqdm([config for _ in range(rounds) for config in grid], desc=f"{args.engine} engine", unit="config")
    ):
        timing, texts = decode(llm, prompts[context], budget or MAX_MODEL_LEN, f"{context}-{budget}-{round_index}")
        timings[context, budget].append(timing)
        if (context, budget) not in answers:
            answers[context, budget] = first_answers(tokenizer, texts)
    for (context, budget), runs in timings.items():
        first = answers[context, budget]
        needle = sum(item["key"] in answer for item, answer in zip(prompts[context], first)) / len(first)
        policy = OFFLOAD if offload else "omnikv" if budget else "full cache"
        for batch_runs in zip(*runs):
            each = [run["ms_per_token"] for run in batch_runs]
            ms = statistics.median(each)
            rows.append(
                {
                    "policy": policy,
                    "budget": budget,
                    "context": context,
                    **batch_runs[-1],
                    "ms_per_token": ms,
                    "decode_tokens_per_s": 1000 * batch_runs[-1]["batch"] / ms,
                    "ms_per_token_rounds": each,
                    "needle_correct": needle,
                    "answers": first,
                }
            )
    config = llm.llm_engine.vllm_config
    omnikv = KVPolicyConfig.from_dict(config.additional_config["kv_policy"]).make_policy()
    num_layers = config.model_config.get_num_layers(config.parallel_config)
    settings = {
        "filter_layers": list(omnikv.filter_layers),
        "dense_layers": omnikv.dense_layers,
        "layers": num_layers,
        "full_attention_layers": sum(source is None for source in omnikv.source_layers(num_layers)),
        "block_size": config.cache_config.block_size,
    }
    return {"rows": rows, "settings": settings}


def add_bounds(rows: list[dict], layers: int, full_attention_layers: int) -> None:
    """Each row's speed-up over the full cache and OmniKV's bound (module docstring), from the same run."""
    full = {(r["context"], r["batch"]): r["ms_per_token"] for r in rows if r["policy"] == "full cache"}
    for row in rows:
        stock, short = full.get((row["context"], row["batch"])), full.get((SHORT_CONTEXT, row["batch"]))
        row["speedup"] = stock / row["ms_per_token"] if stock else None
        row["bound"] = row["of_bound"] = None
        if stock and short and row["context"] > SHORT_CONTEXT and row["policy"] != "full cache":
            row["bound"] = stock / (short + full_attention_layers * (stock - short) / layers)
            row["of_bound"] = row["speedup"] / row["bound"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="contexts 4K and 7.6K, budget 1024")
    parser.add_argument("--contexts", nargs="+", type=int, default=None)
    parser.add_argument("--budgets", nargs="+", type=int, default=None, help="omnikv tokens per sparse layer")
    parser.add_argument(
        "--filter-layers", default=None, help="omnikv filter layers, e.g. 2 (default: the calibrated ones)"
    )
    parser.add_argument("--no-offload", action="store_true", help="skip the --kv-offload engine")
    parser.add_argument(
        "--rounds", type=int, default=1, help="time each cached-engine configuration this many times, in rotation"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "decode.json")
    parser.add_argument("--engine", choices=("cached", "offload"), help=argparse.SUPPRESS)
    parser.add_argument("--engine-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.contexts = args.contexts or ([4096, 7600] if args.quick else [2048, 4096, 7600])
    args.budgets = args.budgets or ([1024] if args.quick else [512, 1024])
    if args.engine:
        args.engine_out.write_text(json.dumps(run_engine(args)))
        return 0

    rows, settings = [], {}
    engine_out = args.out.with_suffix(".engine.tmp")
    for engine in ["cached"] if args.no_offload else ["cached", "offload"]:
        cmd = [
            sys.executable,
            __file__,
            "--engine",
            engine,
            "--engine-out",
            str(engine_out),
            "--contexts",
            *map(str, args.contexts),
            "--budgets",
            *map(str, args.budgets),
            "--rounds",
            str(args.rounds),
        ]
        if args.filter_layers:
            cmd += ["--filter-layers", args.filter_layers]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"the {engine} engine failed")
        result = json.loads(engine_out.read_text())
        rows += result["rows"]
        settings.update(result["settings"])
    engine_out.unlink(missing_ok=True)
    rows.sort(key=lambda row: row["context"])
    full_answers = {row["context"]: row["answers"] for row in rows if row["policy"] == "full cache"}
    for row in rows:
        full = full_answers[row["context"]]
        row["same_answers"] = sum(a == b for a, b in zip(row["answers"], full)) / len(full)
    add_bounds(rows, settings["layers"], settings["full_attention_layers"])
    settings = {
        "contexts": args.contexts,
        "short_context": SHORT_CONTEXT,
        "budgets": args.budgets,
        "depths": DEPTHS,
        "steps": STEPS,
        "rounds": args.rounds,
        "quick": args.quick,
        "host_gib": None if args.no_offload else HOST_GIB,
        **settings,
    }
    write_results(args.out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
