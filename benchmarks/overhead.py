"""The per-head path's decode cost: ``identity`` against vLLM's stock path, in one engine.

    python benchmarks/overhead.py --quick   # 2 requests of 3,000 tokens, 4 rounds
    python benchmarks/overhead.py           # and 8 requests of 1,000 tokens

``identity`` keeps every token in per-head pages, so its step against vLLM's stock path, both in one engine (a request
with ``kv_policy: none``), is the cost of kvpolicy's plumbing alone. Writes ``benchmarks/results/overhead.json``, a
markdown table and ``overhead.png``. Method and columns: docs/benchmarks.md#overhead-runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import RESULTS_DIR, haystack_prompts, plot_timings, write_results  # noqa: E402

STEPS = 64
MODES = {"stock path": {"kv_policy": "none"}, "identity": None}
COLUMNS = [
    "requests",
    "prompt_len",
    "mode",
    "ms_per_step",
    "overhead",
    "fast_ms_per_step",
    "fast_overhead",
    "same_tokens",
    "rounds",
]


@dataclass(frozen=True)
class Case:
    requests: int
    prompt_len: int


PRESETS = {"quick": [Case(2, 3000)], "full": [Case(2, 3000), Case(8, 1000)]}
ROUNDS = 4
BLOCK_SIZE = 128


def decode_round(engine, prompts, extra_args, tag: str) -> tuple[list[float], list[list[int]]]:
    """Read the prompts, time ``STEPS`` decode steps of the whole batch, abort: step seconds, tokens per request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 8, ignore_eos=True, extra_args=extra_args)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), params)
    tokens = {req_id: [] for req_id in ids}

    def step() -> float:
        start = time.perf_counter()
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        return time.perf_counter() - start

    while not all(tokens.values()):
        step()
    times = [step() for _ in range(STEPS)]
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times, [tokens[req_id] for req_id in ids]


def run_case(llm, case: Case, rounds: int, progress) -> list[dict]:
    engine = llm.llm_engine
    prompts = haystack_prompts(llm.get_tokenizer(), [case.prompt_len] * case.requests)
    steps = {mode: [] for mode in MODES}
    medians = {mode: [] for mode in MODES}
    answers = {}
    for round_idx in range(rounds):
        order = list(MODES) if round_idx % 2 == 0 else list(reversed(MODES))
        for mode in order:
            tag = f"{case.requests}x{case.prompt_len}-{round_idx}-{mode}"
            times, tokens = decode_round(engine, prompts, MODES[mode], tag)
            steps[mode] += times
            medians[mode].append(statistics.median(times))
            answers.setdefault(mode, tokens)
            progress.update()
    ratios = [ours / stock for ours, stock in zip(medians["identity"], medians["stock path"])]
    fast = {mode: _decile(times) for mode, times in steps.items()}
    # A request may get its first token a step before the others: compare the tokens both modes produced.
    same = sum(a[: len(b)] == b[: len(a)] for a, b in zip(*answers.values())) / case.requests
    return [
        {
            **asdict(case),
            "mode": mode,
            "ms_per_step": 1000 * statistics.median(steps[mode]),
            "round_ms_per_step": [1000 * m for m in medians[mode]],
            "overhead": statistics.median(ratios) - 1 if mode == "identity" else None,
            "fast_ms_per_step": 1000 * fast[mode],
            "fast_overhead": fast["identity"] / fast["stock path"] - 1 if mode == "identity" else None,
            "step_ms": [1000 * t for t in steps[mode]],
            "same_tokens": same,
            "rounds": rounds,
        }
        for mode in MODES
    ]


def _decile(times: list[float]) -> float:
    """The fastest tenth of the steps: what a path costs when nothing else on the machine interferes."""
    return statistics.quantiles(times, n=10)[0]


def plot(rows: list[dict], path: Path) -> None:
    cases = sorted({(r["requests"], r["prompt_len"]) for r in rows})
    labels = [f"{n} x {length} tokens" for n, length in cases]
    ms = {(r["requests"], r["prompt_len"], r["mode"]): r["ms_per_step"] for r in rows}
    series = [(mode, [ms[(*case, mode)] for case in cases]) for mode in MODES]
    plot_timings(path, labels, series, "decode ms per step (median)", "identity vs vLLM's stock path, one engine")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 requests of 3,000 tokens only")
    parser.add_argument("--rounds", type=int, default=None, help=f"alternating rounds per case (default {ROUNDS})")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "overhead.json")
    args = parser.parse_args()
    rounds = args.rounds or ROUNDS
    cases = PRESETS["quick" if args.quick else "full"]

    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    from tqdm import tqdm
    from vllm import LLM

    import kvpolicy.vllm  # noqa: F401
    from kvpolicy.offline.model import prepare

    longest = max(case.prompt_len for case in cases)
    llm = LLM(
        str(prepare()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=longest + STEPS + 64,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 30,
        block_size=BLOCK_SIZE,
        max_num_seqs=max(case.requests for case in cases),
        seed=0,
        kv_policy="identity",
    )
    rows = []
    with tqdm(total=len(cases) * rounds * len(MODES), desc="decode rounds", unit="round") as progress:
        for case in cases:
            rows += run_case(llm, case, rounds, progress)
    settings = {
        "steps": STEPS,
        "rounds": rounds,
        "cases": [asdict(case) for case in cases],
        "block_size": BLOCK_SIZE,
        "dtype": "float32",
    }
    write_results(args.out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
