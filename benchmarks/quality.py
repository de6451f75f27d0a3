"""Quality harness: long-context tasks through the real engine, every policy x budget, with plots.

    python benchmarks/quality.py --quick   # passkey, niah, multikey at 1K, 6 prompts each; 4 policies at ratio 0.75
    python benchmarks/quality.py           # all six tasks at 1K/2K/4K/8K, 6 prompts per cell, all policies and ratios

Tasks generated from a seed (``benchmarks/tasks.py``), run on the task x contexts the full cache solves, one engine per
policy, budgets per request; every cell is cached under a digest of its prompts, so a run computes only what it lacks.
Writes ``benchmarks/results/quality.json``, a markdown table and a plot. Method and columns:
docs/benchmarks.md#the-task-accuracy-harness.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import queue
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    markdown_table,
    model_folder,
    policy_options,
    write_json,
    write_results,
)
from benchmarks.tasks import TASKS, TaskItem, answer_tokens, score  # noqa: E402

POLICIES = ["snapkv", "adasnap", "pyramid", "adapyramid", "adamix", "streaming", "keydiff", "h2o", "d2o", "omnikv"]
DEPTHS = [0.1, 0.26, 0.42, 0.58, 0.74, 0.9]
FULL = {
    "policies": [*POLICIES, "omnikv@0.7"],
    "budgets": ["128", "256", "512", "0.5", "0.75", "0.9"],
    "tasks": list(TASKS),
    "lengths": [1000, 2000, 4000, 8000],
    "depths": DEPTHS,
    "seeds": 1,
    "first_seed": 0,
}
QUICK = {
    "policies": ["adamix", "adasnap", "keydiff", "omnikv@0.7"],
    "budgets": ["0.75"],
    "tasks": ["passkey", "niah", "multikey"],
    "lengths": [1000],
    "depths": DEPTHS,
    "seeds": 1,
    "first_seed": 0,
}
#: Prompts for choosing variants (``--first-seed 100``); reported numbers use seeds from 0, never these.
DEV_SEED = 100
#: The full cache must answer at least this share of a task x context's prompts for it to count.
RELIABLE = 0.8
#: Tasks the default model answers less often, counted from a lower share: on ``frequent`` (the heavy-hitter
#: task) the full cache names the right person in 60-80% of prompts, and the policies still part from it.
TASK_RELIABLE = {"frequent": 0.6}
PREFILL_CHUNK = 512
MAX_MODEL_LEN = 8192
COLUMNS = ["policy", "budget", "ratio", "task", "context", "accuracy", "n"]


#: The budget label of the full cache's cell: no ``kv_budget``.
FULL_CACHE = "full"


def budget_fields(label: str) -> dict:
    """A budget label as result fields: ``budget`` (tokens) or ``ratio`` (compression ratio); both None for the full cache."""
    value = None if label == FULL_CACHE else float(label)
    ratio = value if value is not None and value < 1 else None
    return {"budget": int(value) if value is not None and ratio is None else None, "ratio": ratio}


def request_budget(label: str, prompt_len: int, policy: str = "none", num_layers: int = 0) -> int | None:
    """A budget label's ``kv_budget`` for one prompt of ``policy``: tokens as given, ``(1 - ratio) * prompt``, or None.

    For a policy that selects context instead of evicting (omnikv) a ratio is ``1 - Mem%``, the paper's unit:
    its sparse layers' budget is what ``--kv-ratio`` (Mem%) gives, so the full-attention layers count in it.
    """
    from kvpolicy.config import KVPolicyConfig
    from kvpolicy.policies import POLICIES, Mode

    fields = budget_fields(label)
    if fields["ratio"] is None:
        return fields["budget"]
    options = {key.removeprefix("kv_"): value for key, value in policy_options(policy).items()}
    if POLICIES[options["policy"]].mode is Mode.SELECT:
        return KVPolicyConfig(**options, ratio=1 - fields["ratio"]).sparse_budget(prompt_len, num_layers)
    return round((1 - fields["ratio"]) * prompt_len)


def layer_count(model: str | None) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_folder(model)).num_hidden_layers


def run_engine(policy: str, cells: list[dict], model: str | None) -> None:
    """One engine, in this process, answering each cell (``budget``, ``items``, ``path``) in turn; a cell's answers
    are written to its ``path`` once they are in, so only its own prompts are ever in flight together."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # on CPU vLLM spawns its engine core: a second vLLM import
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvpolicy.vllm  # noqa: F401

    model = model_folder(model)
    num_layers = layer_count(model)
    largest = max(
        (
            request_budget(cell["budget"], len(item["ids"]), policy, num_layers)
            for cell in cells
            if cell["budget"] != FULL_CACHE
            for item in cell["items"]
        ),
        default=None,
    )
    llm = LLM(
        model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,
        max_num_batched_tokens=PREFILL_CHUNK,
        kv_cache_memory_bytes=2 << 30,
        seed=0,
        **policy_options(policy),
        **({"kv_budget": largest} if largest else {}),
    )
    for cell in tqdm(cells, desc=policy, unit="cell"):
        prompts = [TokensPrompt(prompt_token_ids=item["ids"]) for item in cell["items"]]
        requested = [request_budget(cell["budget"], len(item["ids"]), policy, num_layers) for item in cell["items"]]
        params = [
            SamplingParams(
                max_tokens=answer_tokens(item["task"]),
                temperature=0.0,
                extra_args=None if tokens is None else {"kv_budget": tokens},
            )
            for item, tokens in zip(cell["items"], requested)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        write_json(Path(cell["path"]), {"answers": [o.outputs[0].text for o in outputs]})


def summary_rows(rows: list[dict], reliable: set) -> list[dict]:
    """Each policy x budget's accuracy per task, averaged over the contexts the full cache solves, and the
    ``mean`` of those tasks."""
    groups: dict = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if (row["task"], row["context"]) in reliable:
            groups[(row["policy"], row["budget"], row["ratio"])][row["task"]].append(row["accuracy"])
    summary = []
    for (policy, budget, ratio), by_task in groups.items():
        tasks = {task: sum(accs) / len(accs) for task, accs in by_task.items()}
        summary.append(
            {"policy": policy, "budget": budget, "ratio": ratio, **tasks, "mean": sum(tasks.values()) / len(tasks)}
        )
    return summary


#: The normal quantile of a two-sided 95% interval.
Z95 = 1.96
#: The half-width a family's interval should be under (the issue's 5 points).
HALF_WIDTH = 0.05


def wilson(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a mean of ``n`` scores in [0, 1]: exact in form for hits, and on the safe side
    for partial scores (RULER's shares of answers), whose variance is at most ``mean * (1 - mean)``."""
    if n == 0:
        return 0.0, 1.0
    centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def prompts_needed(mean: float, half_width: float = HALF_WIDTH, z: float = Z95) -> int:
    """The fewest prompts whose Wilson interval around ``mean`` is at most ``half_width`` each side on average."""
    n = 1
    while True:
        low, high = wilson(mean, n, z)
        if high - low <= 2 * half_width:
            return n
        n += 1


def family_rows(rows: list[dict], reliable: set) -> list[dict]:
    """Each policy x budget x task's scores pooled over the contexts the full cache solves: the mean, its 95%
    Wilson interval, the prompts a +-5-point interval needs, and the share of the full cache's mean."""
    pooled: dict = defaultdict(list)
    contexts: dict = defaultdict(set)
    for row in rows:
        if (row["task"], row["context"]) in reliable:
            key = (row["policy"], row["budget"], row["ratio"], row["task"])
            pooled[key] += row["scores"]
            contexts[key].add(row["context"])
    full = {task: sum(s) / len(s) for (policy, _, _, task), s in pooled.items() if policy == "none"}
    out = []
    for (policy, budget, ratio, task), scores in pooled.items():
        mean = sum(scores) / len(scores)
        low, high = wilson(mean, len(scores))
        out.append(
            {
                "policy": policy,
                "budget": budget,
                "ratio": ratio,
                "task": task,
                "contexts": " ".join(f"{c // 1000}K" for c in sorted(contexts[(policy, budget, ratio, task)])),
                "n": len(scores),
                "mean": mean,
                "interval": f"[{low:.3f}, {high:.3f}]",
                "of_full": mean / full[task] if full.get(task) else None,
                "needed_for_5pt": prompts_needed(mean),
            }
        )
    return out


def reliable_cells(rows: list[dict]) -> set:
    return {
        (r["task"], r["context"])
        for r in rows
        if r["policy"] == "none" and r["accuracy"] >= TASK_RELIABLE.get(r["task"], RELIABLE)
    }


def compared_cells(rows: list[dict]) -> set:
    """The solved task x contexts the policies ran on (``--policy-lengths``), where they meet the full cache."""
    ran = {(r["task"], r["context"]) for r in rows if r["policy"] != "none"}
    return reliable_cells(rows) & ran if ran else reliable_cells(rows)


def tables(rows: list[dict]) -> str:
    full = [r for r in rows if r["policy"] == "none"]
    tasks = list(dict.fromkeys(r["task"] for r in full))
    contexts = sorted({r["context"] for r in full})
    by_cell = {(r["task"], r["context"]): r["accuracy"] for r in full}
    baseline = [{"task": t, **{str(c): by_cell.get((t, c)) for c in contexts}} for t in tasks]
    reliable = compared_cells(rows)
    summary = summary_rows(rows, reliable)
    solved = [t for t in tasks if any(task == t for task, _ in reliable)]
    return (
        f"Full cache (`--kv-policy none`): accuracy per task and context (tokens); "
        f"cells at >= {RELIABLE} ({', '.join(f'{t} {v}' for t, v in TASK_RELIABLE.items())}) count below.\n\n"
        + markdown_table(baseline, ["task", *map(str, contexts)])
        + "\n\nEach policy and budget: accuracy per task over the contexts the full cache solves and the policies ran at.\n\n"
        + markdown_table(summary, ["policy", "budget", "ratio", *solved, "mean"])
        + "\n\nEach family, prompts pooled over those contexts: mean score, its 95% Wilson interval, the share of "
        "the full cache's mean, and the prompts a +-5-point interval needs.\n\n"
        + markdown_table(
            sorted(family_rows(rows, reliable), key=lambda r: (r["task"], r["policy"] != "none")),
            ["task", "policy", "budget", "ratio", "contexts", "n", "mean", "interval", "of_full", "needed_for_5pt"],
        )
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reliable = compared_cells(rows)
    summary = summary_rows(rows, reliable)
    tasks = [t for t in dict.fromkeys(r["task"] for r in rows) if any(task == t for task, _ in reliable)]
    kinds = [k for k in ("budget", "ratio") if any(r[k] is not None for r in summary)]
    if not tasks or not kinds:
        fig = plt.figure(figsize=(6, 1.5))
        fig.text(0.5, 0.5, "no policy measured: the full cache solves no task x context of this run", ha="center")
        fig.savefig(path, dpi=110)
        return
    palette = plt.get_cmap("tab20")  # one color per policy: a grid has more than matplotlib's ten
    fig, axes = plt.subplots(len(kinds), len(tasks), figsize=(3.6 * len(tasks), 3.2 * len(kinds)), squeeze=False)
    for row_axes, kind in zip(axes, kinds):
        for ax, task in zip(row_axes, tasks):
            for i, policy in enumerate(dict.fromkeys(r["policy"] for r in summary if r["policy"] != "none")):
                points = sorted((r[kind], r[task]) for r in summary if r["policy"] == policy and r[kind] is not None)
                unbudgeted = [r[task] for r in summary if r["policy"] == policy and r["budget"] is r["ratio"] is None]
                if points:
                    ax.plot(*zip(*points), marker="os^Dv"[i % 5], color=palette(i % 20), label=policy)
                elif unbudgeted:  # a policy that takes no budget (pod@full): one level
                    ax.axhline(unbudgeted[0], ls=":", color=palette(i % 20), label=policy)
            full = next(r[task] for r in summary if r["policy"] == "none")
            ax.axhline(full, color="k", ls="--", label="full cache")
            contexts = sorted(c for t, c in reliable if t == task)
            ax.set_title(f"{task} ({', '.join(f'{c // 1000}K' for c in contexts)})", fontsize=9)
            if kind == "budget":
                ax.set_xscale("log", base=2)
            else:
                ax.set_xlim(0.4, 1.0)
            ax.set_xlabel("budget (tokens per KV head)" if kind == "budget" else "compression ratio (share evicted)")
            ax.set_ylim(-0.05, 1.05)
        row_axes[0].set_ylabel("accuracy")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(
        "Task accuracy vs compression, SmolLM2-135M in vLLM (CPU);\ncontexts the full cache solves", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


#: vLLM's CPU worker binds its OpenMP threads to the cores this names (default: the first free one, so
#: engines started side by side would share it).
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def answer_cells(
    work: Path,
    policy: str,
    budgets: list[str],
    items: list[TaskItem],
    progress,
    core: int | None = None,
    model: str | None = None,
) -> list[dict]:
    """A policy's accuracy rows at each budget, one per task x context of ``items``.

    Each (budget, task, context) cell is a file in ``work`` named by a digest of its prompts (and ``model``): cells
    already there are read, whatever run wrote them; the rest are answered by one engine (bound to ``core`` when
    given) of ``model`` (None: the default model).
    """
    groups: dict = defaultdict(list)
    for item in items:
        groups[(item.task, item.length)].append(item)
    cells = {}
    for (task, length), group in groups.items():
        payload = [asdict(item) for item in group]
        digest = hashlib.sha256(json.dumps(payload if model is None else [payload, model]).encode()).hexdigest()[:12]
        for budget in budgets:
            cells[(budget, task, length)] = (work / f"{policy}@{budget}-{task}-{length}-{digest}.json", payload)
    missing = [key for key, (path, _) in cells.items() if not path.exists()]
    progress.update(len(cells) - len(missing))
    if missing:
        job = work / f"job-{policy}-{os.getpid()}-{core}.json"
        write_json(
            job,
            {
                "policy": policy,
                "model": model,
                "cells": [{"budget": key[0], "items": cells[key][1], "path": str(cells[key][0])} for key in missing],
            },
        )
        env = None if core is None else {**os.environ, THREADS_BIND_ENV: str(core)}
        proc = subprocess.run([sys.executable, __file__, "--run-one", str(job)], env=env)
        if proc.returncode != 0:
            raise SystemExit(
                f"{policy} failed (exit {proc.returncode}, its log is above); finished cells are kept in {work}"
            )
        job.unlink()
        progress.update(len(missing))
    rows = []
    for (budget, task, length), (path, _) in cells.items():
        answers = json.loads(path.read_text())["answers"]
        scores = [score(item, answer) for item, answer in zip(groups[(task, length)], answers)]
        rows.append(
            {
                "policy": policy,
                **budget_fields(budget),
                "task": task,
                "context": length,
                "accuracy": sum(scores) / len(scores),
                "n": len(scores),
                "scores": scores,
            }
        )
    return rows


def answer_in_parallel(
    work: Path, grid: list[tuple[str, list[str]]], items: list[TaskItem], progress, jobs: int, model: str | None = None
) -> list[dict]:
    """``answer_cells`` for every policy of ``grid``, ``jobs`` engines at a time, each bound to a core of its own
    (unless ``VLLM_CPU_OMP_THREADS_BIND`` is set or one job runs); rows in grid order."""
    cores: queue.Queue = queue.Queue()
    for core in sorted(os.sched_getaffinity(0))[: max(jobs, 1)]:
        cores.put(None if jobs <= 1 or THREADS_BIND_ENV in os.environ else core)

    def answer(cell: tuple[str, list[str]]) -> list[dict]:
        core = cores.get()
        try:
            return answer_cells(work, *cell, items, progress, core, model)
        finally:
            cores.put(core)

    with ThreadPoolExecutor(cores.qsize()) as pool:
        return [row for policy_rows in pool.map(answer, grid) for row in policy_rows]


def policy_grid(specs: list[str], budgets: list[str]) -> list[tuple[str, list[str]]]:
    """Each policy spec and its budgets: ``spec@0.7`` that one budget, a plain spec every budget of the run."""
    grid = []
    for spec in specs:
        policy, at, budget = spec.partition("@")
        grid.append((policy, [budget] if at else budgets))
    return grid


def servable(grid: list[tuple[str, list[str]]], lengths: list[int], model: str | None) -> tuple[list, list[str]]:
    """The grid without the (policy, budget) pairs the policy cannot serve at some length, and why each was left out
    (omnikv's full-attention layers alone read more than a high ratio's Mem%)."""
    from kvpolicy.config import KVPolicyConfigError

    num_layers = layer_count(model)
    kept, left_out = [], []
    for policy, budgets in grid:
        fitting = []
        for budget in budgets:
            try:
                for length in lengths:
                    request_budget(budget, length, policy, num_layers)
                fitting.append(budget)
            except KVPolicyConfigError as exc:
                left_out.append(f"{policy}@{budget}: {exc}")
        kept.append((policy, fitting))
    return [(policy, budgets) for policy, budgets in kept if budgets], left_out


def build_items(settings: dict) -> list[TaskItem]:
    from transformers import AutoTokenizer

    from benchmarks.tasks import TaskBuilder

    builder = TaskBuilder(AutoTokenizer.from_pretrained(model_folder(settings["model"])))
    return [
        builder.build(task, length, depth, seed)
        for task in settings["tasks"]
        for length in settings["lengths"]
        for depth in settings["depths"]
        for seed in range(settings["first_seed"], settings["first_seed"] + settings["seeds"])
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small grid, about 10 minutes here")
    parser.add_argument(
        "--policies", nargs="*", help="policy specs, name[:option=value,...][@budget]; the full cache always runs"
    )
    parser.add_argument("--budgets", nargs="+", help="token counts (256) or compression ratios (0.75: a quarter kept)")
    parser.add_argument("--tasks", nargs="+", choices=TASKS)
    parser.add_argument("--lengths", nargs="+", type=int, help="prompt lengths in tokens")
    parser.add_argument(
        "--policy-lengths",
        nargs="+",
        type=int,
        help="the prompt lengths the policies run at (default: every length; the full cache runs at all)",
    )
    parser.add_argument("--depths", nargs="+", type=float)
    parser.add_argument("--seeds", type=int, help="prompts per task, length and depth")
    parser.add_argument(
        "--first-seed", type=int, help=f"the first prompt seed (default 0; {DEV_SEED}: the dev prompts)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="engines at once, each on its own core (default: one per core)",
    )
    parser.add_argument("--out", type=Path, help="default: results/quality.json (quick: quality_quick.json)")
    parser.add_argument(
        "--model",
        default=None,
        help="HF model folder, full cache included (default: the prepared SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--run-one", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_one:
        job = json.loads(args.run_one.read_text())
        run_engine(job["policy"], job["cells"], job["model"])
        return 0

    from tqdm import tqdm

    settings = {**(QUICK if args.quick else FULL), "quick": args.quick, "model": args.model}
    for key in ("policies", "budgets", "tasks", "lengths", "depths", "seeds", "first_seed"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    settings["policy_lengths"] = args.policy_lengths or settings["lengths"]
    grid = policy_grid(settings["policies"], settings["budgets"])
    for label in {b for _, budgets in grid for b in budgets}:
        if label != FULL_CACHE and float(label) <= 0:
            raise SystemExit(f"budget {label}: give a token count or a compression ratio in (0, 1)")
    grid, settings["left_out"] = servable(grid, settings["policy_lengths"], args.model)
    for reason in settings["left_out"]:
        print(f"left out {reason}", file=sys.stderr)
    generated = max(map(answer_tokens, settings["tasks"]))
    if max(settings["lengths"]) + generated > MAX_MODEL_LEN:
        raise SystemExit(f"prompt lengths must leave {generated} tokens under {MAX_MODEL_LEN}")
    out = args.out or RESULTS_DIR / ("quality_quick.json" if args.quick else "quality.json")
    work = out.parent / "quality.work"
    work.mkdir(parents=True, exist_ok=True)
    items = build_items(settings)
    contexts = {(item.task, item.length) for item in items}
    with tqdm(total=len(contexts), desc="cells (policy x budget x task x context)", unit="cell") as progress:
        rows = answer_cells(work, "none", [FULL_CACHE], items, progress, model=args.model)
        reliable = reliable_cells(rows)
        measured = {(task, length) for task, length in reliable if length in settings["policy_lengths"]}
        solved = [item for item in items if (item.task, item.length) in measured]
        if not solved:
            print("the full cache solves no task x context reliably: no policy is run", file=sys.stderr)
        progress.total += len(measured) * sum(len(b) for _, b in grid)
        progress.refresh()
        rows += answer_in_parallel(work, grid if solved else [], solved, progress, args.jobs, args.model)
    settings["reliable"] = RELIABLE
    settings["task_reliable"] = TASK_RELIABLE
    write_results(out, settings, rows, COLUMNS, plot, table=tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
