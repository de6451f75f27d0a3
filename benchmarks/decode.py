"""Long-context decode speed and needle answers: full attention against OmniKV's sparse layers.

    python benchmarks/decode.py --quick   # contexts 4K and 7.6K, budget 1024
    python benchmarks/decode.py           # contexts 2K, 4K and 7.6K, budgets 512 and 1024
    python benchmarks/decode.py --quick --filter-layers 2 --out benchmarks/results/decode_one_filter.json

One engine (``--kv-policy omnikv``, prefix caching on), in this process,
stepped by hand. For each context length, four passkey prompts (key at 20%,
40%, 60%, 80% depth) are read once; every configuration then decodes them
again from the prefix cache, so the prompts are read once per context, not
once per configuration. The full-cache rows are the same engine with a
per-request ``kv_budget`` at least the context, which takes vLLM's stock
attention path exactly (``tests/e2e/test_omnikv.py`` checks it bit for bit).

Per configuration: ``STEPS`` decode steps with all four requests running
(batch 4), then three are aborted and the fourth runs ``STEPS`` more
(batch 1). ``ms_per_token``: median wall time of those steps (each request
gets one token per step; the median, because this shared machine's step
times jump by tens of percent between runs); ``decode_tokens_per_s``: batch / that.
``needle_correct``: the fraction of the four whose first 12 tokens hold their
key; ``same_answers``: the fraction whose first 12 tokens equal the full
cache's (the answers themselves are in the JSON). Writes ``benchmarks/results/decode.json``, a markdown table and
``decode.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ANSWER_QUESTION, RESULTS_DIR, metric_total, passkey_prompts, write_results  # noqa: E402

DEPTHS = [0.2, 0.4, 0.6, 0.8]
STEPS = 24
ANSWER_TOKENS = 12
MAX_MODEL_LEN = 8192
#: Pages the sparse layers read, and the context pages they chose from (omnikv's counters).
PAGE_COUNTERS = ("vllm:kvpolicy_selected_pages", "vllm:kvpolicy_context_pages")
COLUMNS = [
    "policy", "budget", "context", "batch", "decode_tokens_per_s", "ms_per_token", "needle_correct",
    "same_answers", "pages_read",
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
    for batch in (len(ids), 1):
        before = [metric_total(llm.get_metrics(), name) for name in PAGE_COUNTERS]
        times = [step() for _ in range(STEPS)]
        after = [metric_total(llm.get_metrics(), name) for name in PAGE_COUNTERS]
        selected, context = (a - b for a, b in zip(after, before))
        ms = 1000 * statistics.median(times)
        rows.append({"batch": batch, "ms_per_token": ms, "decode_tokens_per_s": 1000 * batch / ms,
                     "pages_read": selected / context if context else 1.0})
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="contexts 4K and 7.6K, budget 1024")
    parser.add_argument("--contexts", nargs="+", type=int, default=None)
    parser.add_argument("--budgets", nargs="+", type=int, default=None, help="omnikv tokens per sparse layer")
    parser.add_argument("--filter-layers", default=None, help="omnikv filter layers, e.g. 2 (default: the calibrated ones)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "decode.json")
    args = parser.parse_args()
    contexts = args.contexts or ([4096, 7600] if args.quick else [2048, 4096, 7600])
    budgets = args.budgets or ([1024] if args.quick else [512, 1024])

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # steps timed here, not across a process boundary
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    import kvpolicy.vllm  # noqa: F401
    from tqdm import tqdm
    from vllm import LLM

    from kvpolicy.model import prepare

    llm = LLM(
        str(prepare()), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True,
        kv_cache_memory_bytes=4 << 30, max_num_seqs=len(DEPTHS), seed=0, disable_log_stats=False,
        kv_policy="omnikv", kv_budget=max(budgets),
        **({"kv_filter_layers": tuple(map(int, args.filter_layers.split(",")))} if args.filter_layers else {}),
    )
    tokenizer = llm.get_tokenizer()
    config = llm.llm_engine.vllm_config.additional_config["kv_policy"]
    rows = []
    grid = [(context, budget) for context in contexts for budget in [None, *budgets]]
    full_answers = {}
    for context, budget in tqdm(grid, desc="configurations", unit="config"):
        prompts = passkey_prompts(tokenizer, DEPTHS, context, ANSWER_QUESTION)
        timing, texts = decode(llm, prompts, budget or MAX_MODEL_LEN, f"{context}-{budget}")
        answers = first_answers(tokenizer, texts)
        full_answers.setdefault(context, answers)  # the full cache runs first at each context
        needle = sum(item["key"] in answer for item, answer in zip(prompts, answers)) / len(prompts)
        same = sum(a == b for a, b in zip(answers, full_answers[context])) / len(prompts)
        for row in timing:
            rows.append({"policy": "omnikv" if budget else "full cache", "budget": budget, "context": context,
                         **row, "needle_correct": needle, "same_answers": same, "answers": answers})
    settings = {
        "contexts": contexts, "budgets": budgets, "depths": DEPTHS, "steps": STEPS, "quick": args.quick,
        "filter_layers": list(config["filter_layers"]), "dense_layers": config["dense_layers"],
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    }
    write_results(args.out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
