"""Answers a job of token-id prompts with kvpress's presses, greedily, in Hugging Face transformers on CPU.

    .venv-kvpress/bin/python benchmarks/kvpress_runner.py MODEL_FOLDER JOB.json ANSWERS.json [--threads N]

Run by ``benchmarks/kvpress_compare.py`` (which writes the job and scores the answers) in .venv-kvpress
(``make kvpress-venv``): kvpress pins an older transformers than the main venv's, so this file imports only torch,
transformers, kvpress and the standard library.

The whole prompt is prefilled in one forward pass under ``with press(model):``, so the press compresses all of it,
the question at its end included (kvpress's pipeline compresses only a context and appends the question
uncompressed). A layer's hook compresses its cache after its attention has run over the full prompt, so the first
answer token comes from the full cache, as in our harness; the others are decoded over the compressed cache at the
positions the uncompressed prompt would give them, as kvpress's pipeline does.

Answers are written after each (press, ratio), and runs already in ANSWERS.json are kept, so a stopped job resumes.
A press that raises is recorded with its error and the job goes on. One progress line per answer on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import sys
import time
import traceback
from pathlib import Path

import kvpress
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as transformers_logging

#: Presses that score from the attention weights a layer returns, which only eager attention returns; the others
#: run under SDPA (AdaKV's head-wise masking patches the registered attention functions, which eager is not).
NEEDS_EAGER = {"ObservedAttentionPress"}
PROGRESS = "progress"


def run_key(run: dict) -> str:
    return f"{run['label']}@{run['ratio']}"


def build_press(run: dict):
    """The kvpress object of a run: ``press`` at ``ratio`` with ``options``, inside ``wrapper`` (AdaKVPress...)."""
    if run["press"] is None:
        return None
    press = getattr(kvpress, run["press"])(compression_ratio=run["ratio"], **run["options"])
    return getattr(kvpress, run["wrapper"])(press=press) if run["wrapper"] else press


def attention_of(run: dict) -> str:
    return "eager" if {run["press"], run["wrapper"]} & NEEDS_EAGER else "sdpa"


def kept_share(model, cache, prompt_len: int) -> float:
    """The share of the prompt's KV entries left after the prefill: cache rows, less AdaKV's masked entries."""
    layers = model.model.layers
    kv_heads = model.config.num_key_value_heads
    kept = 0
    for i, layer in enumerate(layers):
        kept += cache.layers[i].keys.shape[2] * kv_heads
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            kept -= len(masked[0])
    return kept / (len(layers) * kv_heads * prompt_len)


@torch.no_grad()
def answer(model, press, ids: list[int], max_tokens: int, stop: set[int]) -> tuple[list[int], float, float]:
    """Greedy answer tokens to ``ids`` with ``press`` applied to its prefill; the kept share and prefill seconds."""
    cache = DynamicCache()
    start = time.perf_counter()
    with press(model) if press is not None else contextlib.nullcontext():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - start
    kept = kept_share(model, cache, len(ids))
    token = out.logits[0, -1].argmax()
    tokens = [int(token)]
    # Positions go on from the full prompt's length: the kept keys carry their original rotary positions.
    position = len(ids)
    while len(tokens) < max_tokens and tokens[-1] not in stop:
        out = model(
            input_ids=token.view(1, 1), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[position]])
        )
        position += 1
        token = out.logits[0, -1].argmax()
        tokens.append(int(token))
    return tokens, kept, prefill


def stop_tokens(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="HF model folder")
    parser.add_argument("job", type=Path)
    parser.add_argument("answers", type=Path)
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()  # its weight-loading bar would break the caller's tqdm line
    if args.threads:
        torch.set_num_threads(args.threads)
    job = json.loads(args.job.read_text())
    done = json.loads(args.answers.read_text())["runs"] if args.answers.exists() else {}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    models: dict = {}
    versions = {name: importlib.metadata.version(name) for name in ("kvpress", "transformers", "torch")}
    for run in job["runs"]:
        key = run_key(run)
        if key in done and "error" not in done[key]:
            print(PROGRESS, len(job["items"]), flush=True)
            continue
        attn = attention_of(run)
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(
                args.model, dtype=torch.float32, attn_implementation=attn
            ).eval()
        model = models[attn]
        result = {
            **run,
            "attn": attn,
            "answers": [],
            "kept": [],
            "prefill_s": [],
            "seconds": [],
            "cpu_s": [],
            "tokens": [],
        }
        try:
            press = build_press(run)
            for item in job["items"]:
                start, cpu = time.perf_counter(), time.process_time()
                tokens, kept, prefill = answer(
                    model, press, item["ids"], item["max_tokens"], stop_tokens(model, tokenizer)
                )
                result["seconds"].append(time.perf_counter() - start)
                # CPU seconds (all threads): a size for a run that other processes' load does not blur.
                result["cpu_s"].append(time.process_time() - cpu)
                result["answers"].append(tokenizer.decode(tokens, skip_special_tokens=True))
                result["kept"].append(kept)
                result["prefill_s"].append(prefill)
                result["tokens"].append(len(tokens))
                print(PROGRESS, 1, flush=True)
        except Exception as exc:  # one press's failure is a result to report, not the end of the job
            traceback.print_exc()
            result["error"] = f"{type(exc).__name__}: {exc}"
            print(PROGRESS, len(job["items"]) - len(result["answers"]), flush=True)
        done[key] = result
        write_json(args.answers, {"versions": versions, "runs": done})
    return 0


if __name__ == "__main__":
    sys.exit(main())
