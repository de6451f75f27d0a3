"""How much longer one engine run takes as on an x86 CPU without AVX-512, and on slower cores: what
``make test-avx2 CPU_SHARE=S`` stands in for.

    python benchmarks/emulated_cpu.py                  # this CPU; AVX2 code; AVX2 code on cores left 0.55 and 0.4
    python benchmarks/emulated_cpu.py --shares 0.4 --repeats 1 --out /tmp/emulated_cpu.json

Times one ``tests/e2e/engine_run.py`` run from start to exit as this CPU runs it, under ``tests/avx2/avx2.sh``, and on
cores left a share of their time, to compare with the AVX2 EPYC. Method and columns:
docs/benchmarks.md#avx2-emulation-runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # after site-packages: kvpolicy as installed

from benchmarks.common import RESULTS_DIR, model_folder, write_results  # noqa: E402

ENGINE_RUN = REPO / "tests" / "e2e" / "engine_run.py"
AVX2 = REPO / "tests" / "avx2" / "avx2.sh"
CPU_SHARE = REPO / "tests" / "avx2" / "cpu_share.sh"
#: The AVX2 EPYC's range against the AVX-512 one for vLLM's engine (docs/benchmarks.md, Machines).
REAL_AVX2_SLOWDOWN = (3.3, 4.8)


def settings_to_run(shares: list[float]) -> list[tuple[str, list[str]]]:
    """(label, command prefix) per setting: this CPU, AVX2 code, then AVX2 code at each share."""
    rows = [("this CPU", []), ("AVX2 code", [str(AVX2)])]
    rows += [(f"AVX2 code, cores left {share:g}", [str(CPU_SHARE), str(share), str(AVX2)]) for share in shares]
    return rows


def time_run(prefix: list[str], model: str, out: Path) -> float:
    """Seconds from start to exit of one engine run under ``prefix``; its stderr on failure."""
    command = [*prefix, sys.executable, str(ENGINE_RUN), "--model", model, "--policy", "none", "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.4))
    ax.barh([row["setting"] for row in rows], [row["slowdown"] for row in rows])
    low, high = REAL_AVX2_SLOWDOWN
    ax.axvspan(low, high, alpha=0.2, color="tab:red", label="the AVX2 EPYC against the AVX-512 one")
    ax.invert_yaxis()
    ax.set_xlabel("engine run's time against this CPU's (x)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shares", type=float, nargs="*", default=[0.55, 0.4], help="each core's time left")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting")
    parser.add_argument("--model", default=None, help="an HF folder (default: the prepared default model)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "emulated_cpu.json")
    args = parser.parse_args()
    if any(not 0 < share < 1 for share in args.shares):
        parser.error("--shares: each a fraction of a core's time, between 0 and 1")
    model = model_folder(args.model)
    settings = settings_to_run(args.shares)
    seconds: dict[str, list[float]] = {label: [] for label, _ in settings}
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(settings) * args.repeats, desc="engine runs") as bar:
        for _ in range(args.repeats):  # settings interleaved, so a drift in the machine's speed touches all alike
            for label, prefix in settings:
                seconds[label].append(time_run(prefix, model, Path(tmp) / "out.json"))
                bar.update()
    base = statistics.median(seconds["this CPU"])
    rows = [
        {
            "setting": label,
            "seconds": [round(s, 2) for s in seconds[label]],
            "median_s": round(statistics.median(seconds[label]), 2),
            "slowdown": round(statistics.median(seconds[label]) / base, 2),
        }
        for label, _ in settings
    ]
    run_settings = {"engine_run": "tests/e2e/engine_run.py --policy none", "repeats": args.repeats}
    write_results(args.out, run_settings, rows, ["setting", "median_s", "slowdown", "seconds"], plot)


if __name__ == "__main__":
    main()
