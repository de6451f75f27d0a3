"""PoD's grouping threshold δ against what it saves and what it answers: the trade-off curve.

    python benchmarks/pod_delta.py                       # δ 0.5-0.7 at 2K/4K/8K, passkey, niah, multikey
    python benchmarks/pod_delta.py --deltas 0.5 0.6 --lengths 2000
    python benchmarks/pod_delta.py --first-seed 100 --seeds 2 --lengths 2000 4000   # the tuning prompts

A higher δ groups fewer layers, so less K+V is saved and answers come nearer the full cache's; the answers come from
the quality harness. Paper: *Compressing KV Cache for Long-Context LLM Inference with Inter-Layer Attention
Similarity*, arXiv:2412.02252. Writes ``results/pod_delta.json``, a table and a plot. Method and columns:
docs/benchmarks.md#pod-δ-runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import RESULTS_DIR, write_results  # noqa: E402
from kvpolicy.paging.shared import SharedPages  # noqa: E402
from kvpolicy.policies.pod import DEFAULT_GROUPS, LayerGroups, PoD  # noqa: E402

DEFAULTS = {
    "deltas": [0.5, 0.55, 0.6, 0.65, 0.7],
    "lengths": [2000, 4000, 8000],
    "tasks": ["passkey", "niah", "multikey"],
    "block_lengths": [3000, 7000],
}
#: vLLM's CPU default block size, in tokens.
BLOCK_SIZE = 128


def grouping_file(groups: LayerGroups, delta: float, folder: Path) -> Path:
    """``groups`` as a ``--kv-pod-groups`` file, named by ``delta``, relative to the working directory."""
    path = folder / f"delta{delta:g}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"delta": delta, "blocks": groups.blocks}))
    return Path(os.path.relpath(path))


def blocks_freed(pod: PoD, groups: LayerGroups, length: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks one request of ``length`` tokens hands back to vLLM once PoD lays it out: stock's count less
    the layout's (its packed pages and the spare block)."""
    keeps = np.array(groups.keeps_distant_keys())
    layout = SharedPages([0] * groups.num_layers, groups.num_heads, block_size, [], keeps)
    return math.ceil(length / block_size) - layout.blocks_needed(length, pod.distant_range(length))


def accuracy_by_length(runs: list[dict], policy: str, cells: set) -> dict[int, tuple[float, int]]:
    """Mean accuracy over the (task, context) ``cells`` of each context, and the prompts it covers."""
    sums: dict[int, list[float]] = {}
    for run in runs:
        if run["policy"] == policy and (run["task"], run["context"]) in cells:
            total = sums.setdefault(run["context"], [0.0, 0])
            total[0] += run["accuracy"] * run["n"]
            total[1] += run["n"]
    return {length: (hits / n, n) for length, (hits, n) in sums.items()}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for length in sorted({int(key.split("_")[1]) for key in rows[0] if key.startswith("accuracy_")}):
        saved, accuracy = [row[f"kv_saved_{length}"] for row in rows], [row[f"accuracy_{length}"] for row in rows]
        (line,) = ax.plot(saved, accuracy, "o-", label=f"{length}")
        ax.axhline(rows[0][f"full_cache_{length}"], color=line.get_color(), linestyle=":", linewidth=1)
        for row, x, y in zip(rows, saved, accuracy):
            ax.annotate(f"δ {row['delta']:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("K+V saved (fraction of the full cache)")
    ax.set_ylabel("accuracy (passkey, niah, multikey)")
    ax.set_title("PoD: grouping threshold δ, untrained default model (dotted: full cache)")
    ax.legend(title="tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deltas", nargs="+", type=float, default=DEFAULTS["deltas"])
    parser.add_argument("--lengths", nargs="+", type=int, default=DEFAULTS["lengths"])
    parser.add_argument("--tasks", nargs="+", default=DEFAULTS["tasks"])
    parser.add_argument("--seeds", type=int, default=1, help="prompts per task, length and depth (default 1)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first prompt seed (100: the tuning prompts)")
    parser.add_argument(
        "--jobs", type=int, default=len(os.sched_getaffinity(0)), help="engines at once (the harness's --jobs)"
    )
    parser.add_argument(
        "--block-lengths",
        nargs="+",
        type=int,
        default=DEFAULTS["block_lengths"],
        help="prompt lengths at which to count the blocks a request frees",
    )
    parser.add_argument(
        "--similarity", type=Path, default=DEFAULT_GROUPS, help="a calibration JSON with its similarity"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "pod_delta.json")
    args = parser.parse_args()
    if not all(0 <= d <= 1 for d in args.deltas):
        raise SystemExit("--deltas are similarities in [0, 1]")

    groupings = {delta: LayerGroups.load(args.similarity, delta) for delta in args.deltas}
    folder = args.out.parent / "pod_delta_groups"
    policies = {delta: f"pod:pod_groups={grouping_file(g, delta, folder)}" for delta, g in groupings.items()}
    harness = args.out.with_name(args.out.stem + "_quality.json")
    command = [
        sys.executable,
        str(Path(__file__).with_name("quality.py")),
        "--tasks",
        *args.tasks,
        "--lengths",
        *map(str, args.lengths),
        "--seeds",
        str(args.seeds),
        "--first-seed",
        str(args.first_seed),
        "--jobs",
        str(args.jobs),
        "--policies",
        *(f"{policy}@full" for policy in policies.values()),
        "--out",
        str(harness),
    ]
    subprocess.run(command, check=True)
    runs = json.loads(harness.read_text())["runs"]

    solved = {(run["task"], run["context"]) for run in runs if run["policy"] in policies.values()}
    full = accuracy_by_length(runs, "none", solved)
    pod = PoD()
    rows = []
    for delta, groups in groupings.items():
        row = {"delta": delta}
        for length, (accuracy, n) in sorted(accuracy_by_length(runs, policies[delta], solved).items()):
            row |= {
                f"accuracy_{length}": accuracy,
                f"full_cache_{length}": full[length][0],
                f"kv_saved_{length}": pod.saved_fraction(groups, length),
                f"n_{length}": n,
            }
        rows.append(
            row | {f"blocks_freed_{length}": blocks_freed(pod, groups, length) for length in args.block_lengths}
        )
    columns = list(rows[0])  # "delta" first, then each length's and each block length's columns
    settings = {**vars(args), "harness": str(harness), "similarity": str(args.similarity), "out": str(args.out)}
    write_results(args.out, settings, rows, columns, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
