"""kvpress's presses on the quality harness's prompts: accuracy per press, compression ratio and task, and the full cache.

    python benchmarks/kvpress_compare.py --quick   # passkey, niah, multikey, frequent at 1K, 2 depths; 2 presses at 0.9
    python benchmarks/kvpress_compare.py           # the same at 6 depths; 9 presses at ratios 0.9 and 0.95
    python benchmarks/kvpress_compare.py --presses SnapKVPress AdaKVPress+ExpectedAttentionPress --ratios 0.75

The prompts are exactly ``benchmarks/quality.py``'s (its ``build_items``: same tasks, lengths, depths and seeds, the
same token ids), answered greedily (the tasks' answer lengths) in Hugging Face transformers, float32 on CPU, by
``benchmarks/kvpress_runner.py``, and scored by ``benchmarks.tasks.score``. kvpress runs in a venv of its own,
.venv-kvpress (``make kvpress-venv``), because it pins a transformers older than the main venv's: this script builds
the prompts and scores the answers here and runs the runner there.

A press compresses the whole prompt, its question included, after each layer's prefill attention (so the first
answer token sees the full cache, as in our harness); kvpress's ``compression_ratio`` is the share of the prompt's
KV entries removed, our harness's ratio. A press is ``Name[:option=value,...]`` (a kvpress class and its fields) or
``Wrapper+Name[:...]`` (``AdaKVPress+SnapKVPress``: the wrapper's ``press``, the ratio and options the inner's).
SnapKV's window is 32 by default here, our snapkv's: kvpress's 64 is more than the 50 tokens kept at 0.95 of 1K.

``--ours`` adds kvpolicy's rows from a ``benchmarks/quality.py`` results file run with the same tasks, lengths,
depths and seeds (so the same prompts), e.g. ``quality.py --policies adamix adasnap --budgets 0.9 0.95 --tasks passkey
niah multikey frequent --lengths 1000``: each policy is a row ``ours:<policy>`` in the tables.

Answers are kept in ``<out>.work/`` under a digest of the prompts and model, so a rerun computes only what it lacks.
Writes ``<out>`` (default ``benchmarks/results/kvpress_compare.json``), a markdown table and a plot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import RESULTS_DIR, markdown_table, model_folder, write_json, write_results  # noqa: E402
from benchmarks.quality import DEPTHS, build_items, wilson  # noqa: E402
from benchmarks.tasks import TASKS, answer_tokens, score  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).with_name("kvpress_runner.py")
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"
PRESSES = [
    "SnapKVPress:window_size=32",
    "AdaKVPress+SnapKVPress:window_size=32",
    "ExpectedAttentionPress",
    "AdaKVPress+ExpectedAttentionPress",
    "KnormPress",
    "StreamingLLMPress",
    "TOVAPress",
    "ObservedAttentionPress",
    "KeyDiffPress",
]
FULL = {
    "presses": PRESSES,
    "ratios": [0.9, 0.95],
    "tasks": ["passkey", "niah", "multikey", "frequent"],
    "lengths": [1000],
    "depths": DEPTHS,
    "seeds": 1,
    "first_seed": 0,
}
QUICK = {**FULL, "presses": ["SnapKVPress:window_size=32", "ExpectedAttentionPress"], "ratios": [0.9]}
QUICK["depths"] = [DEPTHS[1], DEPTHS[-2]]
#: Task families for the pooled table (RULER's grouping: its multi-value and multi-query NIAH are retrieval).
FAMILIES = {
    "retrieval": ("passkey", "niah", "multikey", "kv", "multivalue", "multiquery"),
    "aggregation": ("frequent", "common_words", "frequent_words"),
    "multi-hop": ("twostage", "variables"),
}
FULL_CACHE = "none"
COLUMNS = ["press", "ratio", "task", "context", "accuracy", "n", "kept", "seconds", "cpu_seconds"]


def option_value(text: str):
    """An option as JSON when it parses (numbers, true/false), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def press_run(spec: str, ratio: float | None) -> dict:
    """A press spec at one ratio as the runner's run: class names, options, and the spec as the label."""
    names, _, rest = spec.partition(":")
    wrapper, _, press = names.rpartition("+")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = option_value(value)
    return {"label": spec, "press": press, "wrapper": wrapper or None, "options": options, "ratio": ratio}


def job_items(settings: dict) -> list[dict]:
    """``quality.build_items``'s prompts with the fields the runner and the table need."""
    items = build_items(settings)
    return [
        {
            "task": item.task,
            "length": item.length,
            "depth": item.depth,
            # build_items draws seeds innermost, so an item's seed follows from its index.
            "seed": settings["first_seed"] + i % settings["seeds"],
            "ids": item.ids,
            "max_tokens": answer_tokens(item.task),
            "item": item,
        }
        for i, item in enumerate(items)
    ]


def run_kvpress(items: list[dict], runs: list[dict], work: Path, model: str, python: Path, threads: int | None) -> dict:
    """The runner's answers to every run, from ``work`` where a previous run left them; progress from its stdout."""
    from tqdm import tqdm

    payload = [{key: value for key, value in item.items() if key != "item"} for item in items]
    digest = hashlib.sha256(json.dumps([payload, model]).encode()).hexdigest()[:12]
    job, answers = work / f"job-{digest}.json", work / f"answers-{digest}.json"
    write_json(job, {"items": payload, "runs": runs})
    cmd = [str(python), str(RUNNER), model, str(job), str(answers), *(["--threads", str(threads)] if threads else [])]
    with (
        tqdm(total=len(items) * len(runs), desc="answers (press x ratio x prompt)", unit="answer") as progress,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc,
    ):
        for line in proc.stdout:
            kind, _, count = line.partition(" ")
            if kind == "progress":
                progress.update(int(count))
            else:
                progress.write(line.rstrip())
    if proc.returncode != 0:
        raise SystemExit(f"kvpress_runner failed (exit {proc.returncode}, its log is above); answers so far: {answers}")
    return json.loads(answers.read_text())


def result_rows(items: list[dict], done: dict) -> tuple[list[dict], list[str]]:
    """One row per run x task x context, and the runs that failed with their errors."""
    rows, failed = [], []
    for run in done["runs"].values():
        if "error" in run:
            failed.append(f"{run['label']}@{run['ratio']}: {run['error']}")
            continue
        cells = defaultdict(list)
        for item, text, kept, seconds, cpu in zip(items, run["answers"], run["kept"], run["seconds"], run["cpu_s"]):
            cells[(item["task"], item["length"])].append((score(item["item"], text), kept, seconds, cpu, text))
        for (task, length), cell in cells.items():
            scores = [c[0] for c in cell]
            rows.append(
                {
                    "press": run["label"],
                    "ratio": run["ratio"],
                    "task": task,
                    "context": length,
                    "accuracy": sum(scores) / len(scores),
                    "n": len(scores),
                    "kept": sum(c[1] for c in cell) / len(cell),
                    "seconds": sum(c[2] for c in cell) / len(cell),
                    "cpu_seconds": sum(c[3] for c in cell) / len(cell),
                    "attn": run["attn"],
                    "scores": scores,
                    "answers": [c[4] for c in cell],
                }
            )
    return rows, failed


def pooled(rows: list[dict], group) -> list[dict]:
    """Scores pooled over rows with the same ``group(row)``: mean, n, Wilson 95% interval, mean kept share."""
    scores, kept = defaultdict(list), defaultdict(list)
    for row in rows:
        key = group(row)
        if key is not None:
            scores[key] += row["scores"]
            kept[key] += [row["kept"]] * row["n"]
    out = []
    for (press, ratio, name), values in scores.items():
        mean = sum(values) / len(values)
        low, high = wilson(mean, len(values))
        out.append(
            {
                "press": press,
                "ratio": ratio,
                "name": name,
                "accuracy": mean,
                "n": len(values),
                "interval": f"[{low:.2f}, {high:.2f}]",
                "kept": sum(kept[(press, ratio, name)]) / len(values),
            }
        )
    return sorted(out, key=lambda r: (r["name"], r["press"] != FULL_CACHE, r["ratio"] or 0, r["press"]))


def our_rows(path: Path, settings: dict) -> list[dict]:
    """kvpolicy's rows of a quality.py results file at this run's ratios, tasks and lengths (not its full cache,
    which the presses' run has on the same prompts)."""
    rows = []
    for run in json.loads(path.read_text())["runs"]:
        if run.get("ratio") in settings["ratios"] and run["task"] in settings["tasks"]:
            if run["context"] in settings["lengths"] and run["policy"] != "full cache":
                fields = ("ratio", "task", "context", "accuracy", "n", "scores")
                rows.append({"press": f"ours:{run['policy']}", **{k: run[k] for k in fields}, "kept": 1 - run["ratio"]})
    if not rows:
        raise SystemExit(f"{path} has no rows at ratios {settings['ratios']} of these tasks and lengths")
    return rows


def family_of(task: str) -> str:
    return next((family for family, tasks in FAMILIES.items() if task in tasks), task)


def tables(rows: list[dict]) -> str:
    by_task = pooled(rows, lambda r: (r["press"], r["ratio"], r["task"]))
    by_family = pooled(rows, lambda r: (r["press"], r["ratio"], family_of(r["task"])))
    seconds = defaultdict(list)
    for row in rows:
        if "seconds" in row:  # kvpress's rows: ours run in vLLM, batched
            seconds[row["press"]] += [(row["seconds"], row["cpu_seconds"])] * row["n"]
    timing = [
        {
            "press": press,
            "s_per_answer": sum(s for s, _ in times) / len(times),
            "cpu_s_per_answer": sum(c for _, c in times) / len(times),
            "answers": len(times),
        }
        for press, times in seconds.items()
    ]
    columns = ["press", "ratio", "accuracy", "n", "interval", "kept"]
    return (
        "Each press, ratio and task: accuracy over the prompts (all contexts), its 95% Wilson interval, and the share "
        "of the prompt's KV entries kept (press `none`: the full cache).\n\n"
        + markdown_table([{"task": r["name"], **r} for r in by_task], ["task", *columns])
        + "\n\nEach family ("
        + "; ".join(f"{family}: {', '.join(tasks)}" for family, tasks in FAMILIES.items())
        + "), the prompts of its tasks in this run pooled.\n\n"
        + markdown_table([{"family": r["name"], **r} for r in by_family], ["family", *columns])
        + "\n\nSeconds per answer (prefill and greedy decode, one prompt at a time): wall clock, and CPU time of all "
        "the runner's threads.\n\n" + markdown_table(timing, ["press", "s_per_answer", "cpu_s_per_answer", "answers"])
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_task = pooled(rows, lambda r: (r["press"], r["ratio"], r["task"]))
    tasks = list(dict.fromkeys(r["name"] for r in by_task))
    presses = list(dict.fromkeys(r["press"] for r in by_task if r["press"] != FULL_CACHE))
    palette = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, press in enumerate(presses):
            points = sorted((r["ratio"], r["accuracy"]) for r in by_task if r["press"] == press and r["name"] == task)
            ax.plot(*zip(*points), marker="os^Dv"[i % 5], color=palette(i % 10), label=press)
        full = [r["accuracy"] for r in by_task if r["press"] == FULL_CACHE and r["name"] == task]
        if full:
            ax.axhline(full[0], color="k", ls="--", label="full cache")
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("compression ratio (share removed)")
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("accuracy")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("kvpress presses on the quality harness's prompts, in transformers (CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 depths, 1 ratio, 2 presses")
    parser.add_argument(
        "--presses", nargs="+", help="Name[:option=value,...] or Wrapper+Name[:...]; the full cache always runs"
    )
    parser.add_argument("--ratios", nargs="+", type=float, help="kvpress compression ratios (share of tokens removed)")
    parser.add_argument("--tasks", nargs="+", choices=TASKS)
    parser.add_argument("--lengths", nargs="+", type=int, help="prompt lengths in tokens")
    parser.add_argument("--depths", nargs="+", type=float)
    parser.add_argument("--seeds", type=int, help="prompts per task, length and depth")
    parser.add_argument("--first-seed", type=int, help="the first prompt seed (default 0, as quality.py)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "kvpress_compare.json")
    parser.add_argument("--model", help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument("--kvpress-python", type=Path, default=KVPRESS_PYTHON, help="the kvpress venv's python")
    parser.add_argument("--threads", type=int, help="the runner's torch threads (default: torch's own)")
    parser.add_argument("--ours", type=Path, help="a quality.py results file on the same prompts: kvpolicy's rows")
    args = parser.parse_args()

    settings = {**(QUICK if args.quick else FULL), "quick": args.quick, "model": args.model}
    for key in ("presses", "ratios", "tasks", "lengths", "depths", "seeds", "first_seed"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if not all(0 < ratio < 1 for ratio in settings["ratios"]):
        raise SystemExit("a compression ratio is the share of tokens removed, in (0, 1)")
    if not args.kvpress_python.exists():
        raise SystemExit(f"{args.kvpress_python} is missing: run `make kvpress-venv`")
    model = model_folder(args.model)
    items = job_items(settings)
    full = {"label": FULL_CACHE, "press": None, "wrapper": None, "options": {}, "ratio": None}
    runs = [full] + [press_run(spec, ratio) for spec in settings["presses"] for ratio in settings["ratios"]]
    work = args.out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    done = run_kvpress(items, runs, work, model, args.kvpress_python, args.threads)
    wanted = {f"{run['label']}@{run['ratio']}" for run in runs}
    done["runs"] = {key: run for key, run in done["runs"].items() if key in wanted}
    rows, settings["failed"] = result_rows(items, done)
    for failure in settings["failed"]:
        print(f"failed: {failure}", file=sys.stderr)
    settings["kvpress_env"] = done["versions"]
    if args.ours:
        rows += our_rows(args.ours, settings)
        settings["ours"] = str(args.ours)
    write_results(args.out, settings, rows, COLUMNS, plot, table=tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
