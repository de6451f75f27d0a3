"""Calibrate OmniKV for a model: measure inter-layer attention similarity, propose filter layers.

    python -m kvpolicy.offline.calibrate [--model PATH] [--prompts N] [--length TOKENS]
                                 [--top-k K] [--span N] [--threshold X] [--out PATH]

A filter layer's picks serve the layers after it only where they attend to the same tokens, and the paper finds that a
property of the layer, not of the task (§5.3): so it is measured once per model, on the essays of our benchmarks, as
the attention mass later layers put on each layer's top-k tokens for the last token, and turned into ``dense_layers``
and ``filter_layers``. The measure, the rule and the default model's numbers: docs/policies.md#omnikv. Paper: *OmniKV:
Dynamic Context Selection for Efficient Long-Context LLMs* (ICLR 2025, no arXiv version).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvpolicy.offline.sample_text import haystack_text
from kvpolicy.policies.omnikv import OmniKV

DEFAULT_OUT = Path("benchmarks/results/omnikv_calibration.json")
MAX_FILTER_LAYERS = 3


def sample_windows(token_ids: list[int], count: int, length: int) -> list[int]:
    """Start offsets of ``count`` windows of ``length`` tokens, evenly spread over ``token_ids``."""
    if len(token_ids) < length:
        raise SystemExit(f"the sample text has {len(token_ids)} tokens: too few for windows of {length}")
    stride = (len(token_ids) - length) // max(1, count - 1) if count > 1 else 0
    return [i * stride for i in range(count)]


def add_model_arguments(parser: argparse.ArgumentParser, length: int) -> None:
    """``--model`` and ``--length``, as every command that runs a model over the essays reads them."""
    parser.add_argument(
        "--model", type=Path, default=None, help="HF model folder (default: the prepared SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--length", type=int, default=length, help=f"tokens per window (default {length})")


def model_label(path: Path | None) -> str:
    return str(path or "SmolLM2-135M-Instruct (kvpolicy-model)")


def provenance(module: str, argv: list[str], versions: dict) -> dict:
    """The command that made a result and the machine it ran on (versions as strings: a checkpoint loads them
    with ``weights_only``)."""
    return {
        "command": " ".join([f"python -m {module}", *argv]),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            **{k: str(v) for k, v in versions.items()},
        },
    }


def load_model(path: Path | None):
    """(model, the essays' token ids, versions): an HF model in float32 with eager attention (it
    returns attention weights); ``path`` None prepares the default model."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        from kvpolicy.offline.model import prepare

        path = prepare()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    token_ids = tokenizer(haystack_text(), add_special_tokens=False, verbose=False)["input_ids"]
    return model, token_ids, {"torch": torch.__version__, "transformers": transformers.__version__}


@torch.inference_mode()
def last_token_attention(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[layers, query heads, n]: every layer's post-softmax attention of the last of ``input_ids`` [1, n].

    All but the last token are prefilled into a KV cache without attention
    outputs; the last token then runs alone with ``output_attentions=True``,
    so each layer returns one row per head instead of an n x n matrix per head.
    """
    prefix = model(input_ids[:, :-1], use_cache=True)
    step = model(input_ids[:, -1:], past_key_values=prefix.past_key_values, output_attentions=True)
    return torch.stack([layer[0, :, -1] for layer in step.attentions]).float()


def similarity_matrix(attention: torch.Tensor, top_k: int) -> torch.Tensor:
    """[layers, layers]: ``sim[i, j]``, layer j's head-mean attention mass on the top-k tokens of layer i's max-over-heads scores."""
    selected = attention.amax(dim=1).topk(min(top_k, attention.shape[-1]), dim=-1).indices
    head_mean = attention.mean(dim=1)
    return head_mean[:, selected].sum(dim=-1).T


def filter_ability(similarity: torch.Tensor, span: int) -> list[float]:
    """Per layer i: mean of ``sim[i, j]`` over the next ``span`` layers; NaN for the last layer."""
    layers = similarity.shape[0]
    return [similarity[i, i + 1 : i + 1 + span].mean().item() if i < layers - 1 else math.nan for i in range(layers)]


def propose(self_recall: list[float], ability: list[float], threshold: float, span: int) -> tuple[int, list[int]]:
    """(dense_layers, filter_layers) by the rule in the module docstring."""
    layers = len(ability)
    last_candidate = layers - 3
    qualified = [i for i in range(last_candidate + 1) if self_recall[i] >= threshold and ability[i] >= threshold]
    if not qualified:
        return layers, []
    filters = [qualified[0]]
    gap = max(1, span // 2)
    while len(filters) < MAX_FILTER_LAYERS:
        window = range(filters[-1] + gap, min(filters[-1] + span, last_candidate) + 1)
        if not window:
            break
        filters.append(max(window, key=lambda layer: ability[layer]))
    return filters[0], filters


def layer_roles(
    similarity: torch.Tensor, dense_layers: int, filter_layers: list[int]
) -> list[tuple[str, float | None]]:
    """Per layer: its role under the proposal and, for sparse layers, ``sim(source filter layer, layer)``: the attention mass it keeps."""
    layers = similarity.shape[0]
    if not filter_layers:
        return [("dense", None)] * layers
    sources = OmniKV(filter_layers=tuple(filter_layers), dense_layers=dense_layers).source_layers(layers)
    roles = []
    for layer, source in enumerate(sources):
        if layer < dense_layers:
            roles.append(("dense", None))
        elif layer in filter_layers:
            roles.append(("filter", None))
        elif source is None:
            roles.append(("full", None))
        else:
            roles.append((f"sparse<-{source}", similarity[source, layer].item()))
    return roles


def plot(
    path: Path,
    rows: list[dict],
    similarity: torch.Tensor,
    threshold: float,
    dense_layers: int,
    filter_layers: list[int],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [row["layer"] for row in rows]
    fig, (curves, heatmap) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.4, 1]})
    curves.plot(
        layers, [row["filter_ability"] for row in rows], "o-", label="filter ability (mean sim to next span layers)"
    )
    curves.plot(layers, [row["self_recall"] for row in rows], "s--", label="self recall (sim to itself)")
    curves.axhline(threshold, color="grey", linewidth=0.8, linestyle=":", label=f"threshold {threshold:g}")
    if dense_layers:
        curves.axvspan(
            -0.5, dense_layers - 0.5, color="grey", alpha=0.15, label=f"dense layers (< L0 = {dense_layers})"
        )
    for i, layer in enumerate(filter_layers):
        curves.axvline(layer, color="tab:red", alpha=0.6, label="proposed filter layers" if i == 0 else None)
    curves.set_xlabel("layer")
    curves.set_ylabel("attention mass on the selected tokens")
    curves.set_ylim(0, 1.02)
    curves.legend(fontsize=8, loc="lower right")
    image = heatmap.imshow(similarity.numpy(), vmin=0, vmax=1, cmap="viridis", origin="upper")
    heatmap.set_xlabel("layer j (attends)")
    heatmap.set_ylabel("layer i (selects)")
    heatmap.set_title("sim(i, j)", fontsize=10)
    fig.colorbar(image, ax=heatmap, fraction=0.046)
    fig.suptitle(f"OmniKV calibration: filter layers {filter_layers}, L0 = {dense_layers}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvpolicy.offline.calibrate", description=__doc__.split("\n")[0])
    add_model_arguments(parser, length=2048)
    parser.add_argument("--prompts", type=int, default=4, help="sample windows of the essays (default 4)")
    parser.add_argument("--top-k", type=int, default=256, help="tokens a layer selects (default 256)")
    parser.add_argument("--span", type=int, default=8, help="following layers a filter layer is scored on (default 8)")
    parser.add_argument(
        "--threshold", type=float, default=0.8, help="self recall and filter ability L0 must reach (default 0.8)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON results; a PNG goes beside it (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    if args.length < 2 or args.prompts < 1 or args.top_k < 1 or args.span < 1:
        parser.error("--length must be at least 2 and --prompts, --top-k, --span at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.perf_counter()

    model, token_ids, versions = load_model(args.model)
    starts = sample_windows(token_ids, args.prompts, args.length)

    similarity = torch.zeros(model.config.num_hidden_layers, model.config.num_hidden_layers)
    for start in tqdm(starts, desc="prompts", unit="prompt"):
        window = torch.tensor([token_ids[start : start + args.length]])
        similarity += similarity_matrix(last_token_attention(model, window), args.top_k)
    similarity /= len(starts)

    self_recall = similarity.diagonal().tolist()
    ability = filter_ability(similarity, args.span)
    dense_layers, filter_layers = propose(self_recall, ability, args.threshold, args.span)
    roles = layer_roles(similarity, dense_layers, filter_layers)
    rows = [
        {
            "layer": layer,
            "self_recall": recall,
            "filter_ability": None if math.isnan(score) else score,
            "role": role,
            "kept_mass": kept,
        }
        for layer, (recall, score, (role, kept)) in enumerate(zip(self_recall, ability, roles))
    ]
    seconds = time.perf_counter() - started

    print(f"\n{'layer':>5}  {'self recall':>11}  {'filter ability':>14}  {'kept mass':>9}  role")
    for row in rows:
        score = "-" if row["filter_ability"] is None else f"{row['filter_ability']:.3f}"
        kept = "-" if row["kept_mass"] is None else f"{row['kept_mass']:.3f}"
        print(f"{row['layer']:>5}  {row['self_recall']:>11.3f}  {score:>14}  {kept:>9}  {row['role']}")
    print(
        f"\nproposal: --kv-dense-layers {dense_layers} --kv-filter-layers {','.join(map(str, filter_layers)) or '(none)'}"
    )

    payload = {
        **provenance("kvpolicy.offline.calibrate", argv, versions),
        "settings": {
            "model": model_label(args.model),
            "prompts": args.prompts,
            "length": args.length,
            "top_k": args.top_k,
            "span": args.span,
            "threshold": args.threshold,
            "window_starts": starts,
            "selector": "last token, max over query heads (eq. 4)",
        },
        "seconds": round(seconds, 1),
        "layers": rows,
        "similarity": [[round(value, 5) for value in row] for row in similarity.tolist()],
        "dense_layers": dense_layers,
        "filter_layers": filter_layers,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    plot(args.out.with_suffix(".png"), rows, similarity, args.threshold, dense_layers, filter_layers)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
