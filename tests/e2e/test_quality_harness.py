"""The quality harness end to end on a tiny grid: real engines, results contract, resuming without engines."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRID = [
    "--policies",
    "snapkv",
    "--budgets",
    "128",
    "0.75",
    "--tasks",
    "niah",
    "--lengths",
    "1000",
    "--depths",
    "0.5",
    "--seeds",
    "1",
]


def run(out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), *GRID, "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_tiny_grid_writes_the_contract_and_resumes_from_its_cells(tmp_path):
    out = tmp_path / "quality.json"
    first = run(out)
    assert first.returncode == 0, first.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert {(r["policy"], r["budget"], r["ratio"]) for r in runs} == {
        ("none", None, None),
        ("snapkv", 128, None),
        ("snapkv", None, 0.75),
    }
    for row in runs:
        assert row["task"] == "niah" and row["context"] == 1000 and row["n"] == 1
        assert row["accuracy"] in (0.0, 1.0)
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()

    cells = {p.name: p.stat().st_mtime_ns for p in (out.parent / "quality.work").iterdir()}
    assert len(cells) == 3, cells  # none, snapkv@128, snapkv@0.75
    second = run(out)
    assert second.returncode == 0, second.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in (out.parent / "quality.work").iterdir()} == cells, (
        "a cell was recomputed"
    )
    assert json.loads(out.read_text())["runs"] == runs
