"""Quality against the full cache, through the real engine: fidelity and passkey retrieval, policies x budgets.

    python benchmarks/fidelity.py --quick   # 2 prompts, budget 256, passkey at 50%; stock + 4 policies
    python benchmarks/fidelity.py           # 20 prompts of 2K-4K tokens, budgets 128/256/512, 5 depths

Each policy reads the full cache's prompts, compresses them and is teacher-forced along its 64 greedy tokens
(``top1_agreement``, ``mean_kl``); passkey retrieval at several depths. One engine per policy. Writes
``benchmarks/results/fidelity.json``, a markdown table and ``fidelity.png``. Method and columns:
docs/benchmarks.md#fidelity-runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import (  # noqa: E402
    FORCE_KEY,
    RESULTS_DIR,
    forcing_processor,
    haystack_prompts,
    model_folder,
    passkey_prompts,
    policy_options,
    write_results,
)

#: ``name`` or ``name:option=value`` (``common.policy_options``).
POLICIES = ["snapkv", "adasnap", "pyramid", "adapyramid", "streaming", "keydiff", "h2o", "d2o", "omnikv"]
#: In the quick mode (<= 10 min here): the default policy and the eviction and merging policies.
QUICK_POLICIES = ["adasnap", "keydiff", "h2o", "d2o"]
#: Also in the full mode: D2O's eviction without its merging, to see what merging buys.
ABLATIONS = ["d2o:merge=false"]
CONTINUATION = 64
#: Prefill chunk (--max-num-batched-tokens): keydiff evicts after each one.
PREFILL_CHUNK = 512
TOP_LOGPROBS = 20
PASSKEY_LEN = 3000
PASSKEY_ANSWER_TOKENS = 12
COLUMNS = ["policy", "budget", "top1_agreement", "mean_kl", "passkey_accuracy", "passkey_hits"]


def run_engine(tasks: dict, policy: str, budgets: list[int], model: str | None) -> dict:
    """One engine, in this process: continuations (forced when a reference is given) and passkey answers,
    once per budget (once with none for stock and for a policy that takes no budget)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the logits processor class is defined here
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvpolicy.vllm  # noqa: F401

    stock = policy == "stock"
    llm = LLM(
        model_folder(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=4200,
        enable_prefix_caching=False,
        max_num_batched_tokens=PREFILL_CHUNK,
        kv_cache_memory_bytes=2 << 30,
        seed=0,
        logits_processors=[forcing_processor()],
        **({} if stock else policy_options(policy)),
        **({"kv_budget": max(budgets)} if budgets else {}),
    )
    prompts, params, keys = [], [], []
    for budget in budgets or [None]:
        extra = {} if budget is None else {"kv_budget": budget}
        for i, ids in enumerate(tasks["fidelity"]):
            forced = None if stock else {FORCE_KEY: tasks["reference"][i]}
            prompts.append(ids)
            params.append(
                SamplingParams(
                    max_tokens=CONTINUATION,
                    temperature=0.0,
                    ignore_eos=True,
                    logprobs=TOP_LOGPROBS,
                    extra_args={**extra, **(forced or {})} or None,
                )
            )
            keys.append(("fidelity", budget, i))
        for i, item in enumerate(tasks["passkey"]):
            prompts.append(item["ids"])
            params.append(SamplingParams(max_tokens=PASSKEY_ANSWER_TOKENS, temperature=0.0, extra_args=extra or None))
            keys.append(("passkey", budget, i))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=True)
    results: dict = {"fidelity": {}, "passkey": {}}
    for (kind, budget, _), output in zip(keys, outputs):
        completion = output.outputs[0]
        if kind == "fidelity":
            steps = [{str(t): [lp.logprob, lp.rank] for t, lp in step.items()} for step in completion.logprobs]
            results["fidelity"].setdefault(str(budget), []).append(
                {"token_ids": list(completion.token_ids), "logprobs": steps}
            )
        else:
            results["passkey"].setdefault(str(budget), []).append(completion.text)
    return results


def truncated_kl(full: dict, compressed: dict) -> float:
    """KL(full || compressed) on the full cache's top tokens, each side renormalized there."""
    floor = min(lp for lp, rank in compressed.values() if rank <= TOP_LOGPROBS)
    support = [t for t, (_, rank) in full.items() if rank <= TOP_LOGPROBS]
    p = [full[t][0] for t in support]
    q = [compressed.get(t, (floor, None))[0] for t in support]
    log_zp = math.log(sum(math.exp(x) for x in p))
    log_zq = math.log(sum(math.exp(x) for x in q))
    return sum(math.exp(a - log_zp) * ((a - log_zp) - (b - log_zq)) for a, b in zip(p, q))


def fidelity_row(reference: list[dict], forced: list[dict]) -> dict:
    agree, kls = [], []
    for ref, run in zip(reference, forced):
        for token, full_step, step in zip(ref["token_ids"], ref["logprobs"], run["logprobs"]):
            top1 = next(int(t) for t, (_, rank) in step.items() if rank == 1)
            agree.append(top1 == token)
            kls.append(truncated_kl(full_step, step))
    return {"top1_agreement": sum(agree) / len(agree), "mean_kl": sum(kls) / len(kls)}


def passkey_row(answers: list[str], passkeys: list[dict]) -> dict:
    hits = [item["key"] in answer for answer, item in zip(answers, passkeys)]
    return {
        "passkey_accuracy": sum(hits) / len(hits),
        "passkey_hits": "".join("x" if hit else "." for hit in hits),
        "passkey_by_depth": {str(item["depth"]): hit for item, hit in zip(passkeys, hits)},
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, ax in zip(("top1_agreement", "mean_kl", "passkey_accuracy"), axes):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            subset = [r for r in rows if r["policy"] == policy and r["budget"] is not None]
            if subset:
                ax.plot([r["budget"] for r in subset], [r[name] for r in subset], marker="o", label=policy)
            else:
                ax.axhline(
                    next(r[name] for r in rows if r["policy"] == policy),
                    color="k" if policy == "full cache" else None,
                    ls="--",
                    label=policy,
                )
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_title(name)
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    fig.suptitle("kvpolicy quality vs the full cache (SmolLM2-135M, vLLM CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, budget 256, passkey at 50%%, 4 policies")
    parser.add_argument(
        "--policies", nargs="+", default=None, help=f"default: all and the ablation (quick: {' '.join(QUICK_POLICIES)})"
    )
    parser.add_argument("--budgets", nargs="+", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None, help="fidelity prompts (quick 2, full 20)")
    parser.add_argument("--depths", nargs="+", type=float, default=None, help="passkey depths (quick 0.5, full 5)")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: results/fidelity.json (quick: fidelity_quick.json)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="HF model folder, full cache included (default: the prepared SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--run-one", nargs=3, metavar=("TASKS", "POLICY", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--run-budgets", nargs="+", type=int, default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_one:
        tasks_path, policy, out = args.run_one
        tasks = json.loads(Path(tasks_path).read_text())
        Path(out).write_text(json.dumps(run_engine(tasks, policy, args.run_budgets, args.model)))
        return 0

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from kvpolicy.policies import POLICIES

    out = args.out or RESULTS_DIR / ("fidelity_quick.json" if args.quick else "fidelity.json")
    policies = args.policies or (QUICK_POLICIES if args.quick else POLICIES + ABLATIONS)
    count = args.prompts or (2 if args.quick else 20)
    budgets = args.budgets or ([256] if args.quick else [128, 256, 512])
    depths = args.depths or ([0.5] if args.quick else [0.0, 0.25, 0.5, 0.75, 1.0])
    tokenizer = AutoTokenizer.from_pretrained(model_folder(args.model))
    lengths = [round(2048 + i * (4000 - 2048) / max(count - 1, 1)) for i in range(count)]
    tasks = {
        "fidelity": haystack_prompts(tokenizer, lengths),
        "passkey": passkey_prompts(tokenizer, depths, PASSKEY_LEN),
    }

    work = out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    tasks_path = work / "tasks.json"

    def engine(policy: str, run_budgets: list[int]) -> dict:
        """One engine's results; kept in ``work`` under a digest of its inputs, so a rerun resumes."""
        inputs = json.dumps([tasks, policy, run_budgets, args.model], sort_keys=True)
        cached = work / f"{policy}-{hashlib.sha256(inputs.encode()).hexdigest()[:12]}.json"
        if cached.exists():
            return json.loads(cached.read_text())
        tasks_path.write_text(json.dumps(tasks))
        cmd = [sys.executable, __file__, "--run-one", str(tasks_path), policy, str(cached)]
        if args.model:
            cmd += ["--model", args.model]
        proc = subprocess.run(
            cmd + ["--run-budgets", *map(str, run_budgets)] if run_budgets else cmd, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SystemExit(f"{policy} failed:\n{proc.stderr[-3000:]}")
        return json.loads(cached.read_text())

    rows = []
    with tqdm(total=1 + len(policies), desc="engines", unit="engine") as progress:
        full = engine("stock", [])
        progress.update()
        reference = full["fidelity"]["None"]
        tasks["reference"] = [r["token_ids"] for r in reference]
        rows.append(
            {
                "policy": "full cache",
                "budget": None,
                "top1_agreement": 1.0,
                "mean_kl": 0.0,
                **passkey_row(full["passkey"]["None"], tasks["passkey"]),
            }
        )
        for policy in policies:
            policy_budgets = budgets if POLICIES[policy.partition(":")[0]].needs_budget else []
            result = engine(policy, policy_budgets)
            progress.update()
            for budget in policy_budgets or [None]:
                rows.append(
                    {
                        "policy": policy,
                        "budget": budget,
                        **fidelity_row(reference, result["fidelity"][str(budget)]),
                        **passkey_row(result["passkey"][str(budget)], tasks["passkey"]),
                    }
                )
    for path in work.iterdir():
        path.unlink()
    work.rmdir()

    settings = {
        "prompt_lens": lengths,
        "continuation": CONTINUATION,
        "top_logprobs": TOP_LOGPROBS,
        "passkey_len": PASSKEY_LEN,
        "passkey_depths": depths,
        "prefill_chunk": PREFILL_CHUNK,
        "quick": args.quick,
        "model": args.model or "SmolLM2-135M-Instruct (kvpolicy-model)",
    }
    write_results(out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
