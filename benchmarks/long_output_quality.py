"""What compressing in decode costs: short prompts, long outputs, a budget of a quarter of the output.

    python benchmarks/long_output_quality.py           # 8 prompts of 200 tokens, 1,024 output tokens, budget 256
    python benchmarks/long_output_quality.py --quick   # 2 prompts, 512 output tokens, budget 128
    python benchmarks/long_output_quality.py --policies omnikv:filter_layers=2+9+17 --block-size 32   # 32-token pages

Each prompt is within the budget, so a policy compresses only once decode takes the cache past it
(``--kv-decode-buffer``, default one page). Three measures against the full cache (stock vLLM), same prompts:

- ``top1_agreement``, ``mean_kl``: the policy teacher-forced along the full cache's greedy output; the share of
  steps where its own greedy token is the full cache's, and KL on the full cache's top 20 tokens.
- ``loglik``: the policy's own greedy output scored by the full cache (mean log-probability per output token),
  beside the full cache's own greedy output (``loglik_full``).
- ``recall``: the output begins with a key sentence, then text up to ``--output-len``, then a question; the
  answer the model writes must hold the key. The output before the answer is teacher-forced (the model does
  not choose the key), so the key sits among the generated tokens that decode compresses. Kept only where the
  full cache answers >= 0.8 (``recall_solvable``).

Prompts and keys come from ``--seed``: on seed 1 the full cache missed the key at depth 0.25 under the fidelity
benchmark's question, so the task asks in the quality harness's ``Answer:`` form; reported runs use seed 2. The
policies' settings were not tuned (the buffer is the default, the budget a quarter of the output). One engine per policy and one more that scores. Writes
``benchmarks/results/long_output_quality.json``, a table and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import (  # noqa: E402
    ANSWER_QUESTION,
    FORCE_KEY,
    RESULTS_DIR,
    forcing_processor,
    model_folder,
    policy_options,
    write_results,
)
from benchmarks.fidelity import TOP_LOGPROBS, fidelity_row  # noqa: E402

PRESETS = {
    "full": {"prompts": 8, "output_len": 1024},
    "quick": {"prompts": 2, "output_len": 512},
}
POLICIES = ["adamix", "rkv", "keydiff", "h2o"]
PROMPT_LEN = 200
ANSWER_TOKENS = 12
#: Where in the output the key sentence sits (0: the first output tokens).
DEPTHS = [0.0, 0.25, 0.5]
SOLVABLE = 0.8
COLUMNS = ["policy", "budget", "top1_agreement", "mean_kl", "loglik", "loglik_full", "recall", "recall_hits"]


def make_tasks(tokenizer, prompts: int, output_len: int, seed: int) -> dict:
    """Prompts of ``PROMPT_LEN`` haystack tokens from places ``seed`` picks; per prompt and depth, a forced output
    that states a key at that depth of ``output_len`` tokens and ends in the question."""
    from kvpolicy.offline.sample_text import haystack_text

    rng = random.Random(seed)
    ids = tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]

    def text(length: int) -> list[int]:
        start = rng.randrange(len(ids) - length)
        return ids[start : start + length]

    question = tokenizer(ANSWER_QUESTION, add_special_tokens=False)["input_ids"]
    base = [text(PROMPT_LEN) for _ in range(prompts)]
    recall = []
    for prompt in base:
        for depth in DEPTHS:
            key = str(rng.randrange(10000, 100000))
            needle = tokenizer(f" My pass key is {key}. Remember it. {key} is my pass key. ", add_special_tokens=False)
            filler = text(output_len - len(needle["input_ids"]) - len(question))
            at = round(depth * len(filler))
            forced = filler[:at] + needle["input_ids"] + filler[at:] + question
            recall.append({"prompt": prompt, "forced": forced, "key": key, "depth": depth})
    return {"prompts": base, "recall": recall, "output_len": output_len}


def run_engine(tasks: dict, policy: str, budget: int | None, score: list | None, block_size: int | None = None) -> dict:
    """One engine, in this process. With ``score``: the full cache's log-probabilities of each (prompt, output);
    otherwise the greedy outputs, the forced run along ``tasks["reference"]`` (a policy) and the recall answers."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the forcing processor is defined in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvpolicy.vllm  # noqa: F401

    output_len = tasks["output_len"]
    llm = LLM(
        model_folder(None),
        dtype="float32",
        enforce_eager=True,
        max_model_len=PROMPT_LEN + output_len + ANSWER_TOKENS,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        logits_processors=[forcing_processor()],
        **({} if block_size is None else {"block_size": block_size}),
        **({} if policy == "stock" else {**policy_options(policy), "kv_budget": budget}),
    )
    if score is not None:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p + o) for p, o in score], params, use_tqdm=True)
        return {
            "loglik": [
                [step[token].logprob for token, step in zip(o, out.prompt_logprobs[len(p) :])]
                for (p, o), out in zip(score, outputs)
            ]
        }
    prompts, params, kinds = [], [], []
    for prompt in tasks["prompts"]:  # the full cache's with its top tokens: the reference of the forced runs
        prompts.append(prompt)
        top = TOP_LOGPROBS if policy == "stock" else None
        params.append(SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=top))
        kinds.append("greedy")
    if policy != "stock":
        for prompt, reference in zip(tasks["prompts"], tasks["reference"]):
            prompts.append(prompt)
            forced = {FORCE_KEY: reference}
            params.append(
                SamplingParams(
                    max_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS, extra_args=forced
                )
            )
            kinds.append("forced")
    for item in tasks["recall"]:
        prompts.append(item["prompt"])
        forced = {FORCE_KEY: item["forced"]}
        params.append(
            SamplingParams(max_tokens=len(item["forced"]) + ANSWER_TOKENS, temperature=0.0, extra_args=forced)
        )
        kinds.append("recall")
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=True)
    results: dict = {"greedy": [], "forced": [], "recall": []}
    for kind, output, item in zip(kinds, outputs, [None] * (len(kinds) - len(tasks["recall"])) + tasks["recall"]):
        completion = output.outputs[0]
        if kind in ("greedy", "forced"):
            steps = [{str(t): [lp.logprob, lp.rank] for t, lp in step.items()} for step in completion.logprobs or []]
            results[kind].append({"token_ids": list(completion.token_ids), "logprobs": steps})
        else:
            answer = list(completion.token_ids)[len(item["forced"]) :]
            results[kind].append(llm.get_tokenizer().decode(answer))
    return results


def in_engine(
    work: Path, tasks: dict, policy: str, budget: int | None, score: list | None = None, block_size: int | None = None
) -> dict:
    """``run_engine`` in a fresh process (each engine its own, as in the other benchmarks)."""
    path = work / f"{policy}.in.json"
    spec = {"tasks": tasks, "policy": policy, "budget": budget, "score": score, "block_size": block_size}
    path.write_text(json.dumps(spec))
    out = work / f"{policy}.out.json"
    proc = subprocess.run([sys.executable, __file__, "--run-one", str(path), str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{policy} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def recall_row(answers: list[str], items: list[dict]) -> dict:
    hits = [item["key"] in answer for answer, item in zip(answers, items)]
    return {
        "recall": sum(hits) / len(hits),
        "recall_hits": "".join("x" if hit else "." for hit in hits),
        "recall_answers": answers,
    }


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [r["policy"] for r in rows]
    for ax, column in zip(axes, ("top1_agreement", "loglik", "recall")):
        ax.bar(names, [r[column] for r in rows], color=["k" if n == "full cache" else "C0" for n in names])
        ax.set_title(column)
    fig.suptitle(f"compressing in decode: budget {rows[-1]['budget']} tokens per KV head, SmolLM2-135M, vLLM CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, 512 output tokens")
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None, help="default: a quarter of --output-len")
    parser.add_argument("--seed", type=int, default=2, help="prompts and keys (1: the tuning prompts)")
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's page size (default: the platform's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--run-one", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_one:
        source, out = args.run_one
        spec = json.loads(Path(source).read_text())
        run = run_engine(spec["tasks"], spec["policy"], spec["budget"], spec["score"], spec["block_size"])
        Path(out).write_text(json.dumps(run))
        return 0

    from tqdm import tqdm
    from transformers import AutoTokenizer

    preset = PRESETS["quick" if args.quick else "full"]
    prompts = args.prompts or preset["prompts"]
    output_len = args.output_len or preset["output_len"]
    budget = args.budget or output_len // 4
    out = args.out or RESULTS_DIR / ("long_output_quality_quick.json" if args.quick else "long_output_quality.json")
    tasks = make_tasks(AutoTokenizer.from_pretrained(model_folder(None)), prompts, output_len, args.seed)
    work = out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)

    with tqdm(total=len(args.policies) + 2, desc="engines", unit="engine") as progress:
        full = in_engine(work, tasks, "stock", None, block_size=args.block_size)
        progress.update()
        tasks["reference"] = [run["token_ids"] for run in full["greedy"]]
        runs = {}
        for policy in args.policies:
            runs[policy] = in_engine(work, tasks, policy, budget, block_size=args.block_size)
            progress.update()
        texts = [full["greedy"], *(run["greedy"] for run in runs.values())]
        pairs = [[p, o["token_ids"]] for outputs in texts for p, o in zip(tasks["prompts"], outputs)]
        scored = in_engine(work, tasks, "stock", None, score=pairs, block_size=args.block_size)["loglik"]
        progress.update()
    for path in work.iterdir():
        path.unlink()
    work.rmdir()

    per_text = [mean(values) for values in scored]
    loglik = [mean(per_text[i * prompts : (i + 1) * prompts]) for i in range(len(texts))]
    full_recall = recall_row(full["recall"], tasks["recall"])
    rows = [
        {
            "policy": "full cache",
            "budget": None,
            "top1_agreement": 1.0,
            "mean_kl": 0.0,
            "loglik": loglik[0],
            "loglik_full": loglik[0],
            **full_recall,
        }  # fmt: skip
    ]
    for i, (policy, run) in enumerate(runs.items(), start=1):
        rows.append(
            {
                "policy": policy,
                "budget": budget,
                **fidelity_row(full["greedy"], run["forced"]),
                "loglik": loglik[i],
                "loglik_full": loglik[0],
                **recall_row(run["recall"], tasks["recall"]),
            }
        )
    settings = {
        "prompts": prompts,
        "prompt_len": PROMPT_LEN,
        "output_len": output_len,
        "budget": budget,
        "decode_buffer": "default (one page)",
        "block_size": args.block_size or "platform default",
        "depths": DEPTHS,
        "seed": args.seed,
        "recall_solvable": full_recall["recall"] >= SOLVABLE,
        "model": "SmolLM2-135M-Instruct (kvpolicy-model)",
    }
    write_results(out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
