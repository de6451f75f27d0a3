"""Group a model's layers for PoD: head-wise inter-layer attention similarity, then Algorithm 1.

    python -m kvpolicy.offline.calibrate_pod [--model PATH] [--prompts N] [--length TOKENS]
                                     [--queries Q] [--delta X] [--out PATH]

The sibling of ``python -m kvpolicy.offline.calibrate`` on the same essays: one minus the Jensen-Shannon
divergence of two layers' attention rows per KV head, grouped by Algorithm 1 at ``--delta`` (0.65 for the
untrained default model). The JSON, with the similarity so ``--kv-pod-delta`` can regroup it, is what
``--kv-pod-groups`` reads; how and why: docs/policies.md#pod. Paper: *Compressing KV Cache for Long-Context
LLM Inference with Inter-Layer Attention Similarity*, arXiv:2412.02252.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvpolicy.offline.calibrate import add_model_arguments, load_model, model_label, provenance, sample_windows
from kvpolicy.policies.pod import DEFAULT_GROUPS, LayerGroups, PoD, group_layers, js_similarity


@torch.inference_mode()
def last_queries_attention(model, input_ids: torch.Tensor, queries: int) -> torch.Tensor:
    """[layers, query heads, queries, n]: each layer's attention of the last ``queries`` tokens of ``input_ids`` [1, n]."""
    prefix = model(input_ids[:, :-queries], use_cache=True)
    step = model(input_ids[:, -queries:], past_key_values=prefix.past_key_values, output_attentions=True)
    return torch.stack([layer[0] for layer in step.attentions]).float()


def head_similarity(attention: torch.Tensor) -> torch.Tensor:
    """[query heads, layers, layers]: ``sim_h(a, b)``, one minus JS divergence averaged over the rows."""
    layers = attention.shape[0]
    sim = torch.empty(attention.shape[1], layers, layers, dtype=torch.float64)
    for a in range(layers):
        sim[:, a, :] = js_similarity(attention[a : a + 1], attention).mean(dim=-1).T
    return sim


def kv_head_similarity(sim: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[kv heads, layers, layers]: the mean over each KV head's query heads (query head q is KV head q // group)."""
    return sim.view(num_kv_heads, sim.shape[0] // num_kv_heads, *sim.shape[1:]).mean(dim=1)


def plot(path: Path, sim: torch.Tensor, groups: LayerGroups, delta: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sim.shape[0]
    fig, axes = plt.subplots(1, heads, figsize=(4.6 * heads, 4.4), squeeze=False)
    for head, ax in enumerate(axes[0]):
        image = ax.imshow(sim[head].numpy(), vmin=0, vmax=1, cmap="viridis")
        for block in groups.blocks[head]:
            start, end = block[0] - 0.5, block[-1] + 0.5
            ax.add_patch(
                plt.Rectangle((start, start), end - start, end - start, fill=False, edgecolor="red", linewidth=1.2)
            )
        ax.set_title(f"KV head {head}: {len(groups.blocks[head])} blocks", fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.02)
    fig.suptitle(f"PoD: 1 - JS divergence between layers' attention; blocks at delta = {delta:g} (red)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvpolicy.offline.calibrate_pod", description=__doc__.split("\n")[0]
    )
    add_model_arguments(parser, length=2048)
    parser.add_argument("--prompts", type=int, default=4, help="sample windows of the essays (default 4)")
    parser.add_argument(
        "--queries", type=int, default=32, help="last tokens whose attention rows are compared (default 32)"
    )
    parser.add_argument(
        "--delta",
        type=float,
        default=0.65,
        help="similarity a layer needs to join a block (default 0.65; the paper's 0.5 assumes its post-training)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_GROUPS,
        help=f"grouping JSON; a PNG goes beside it (default {DEFAULT_GROUPS})",
    )
    args = parser.parse_args(argv)
    if args.prompts < 1 or not 1 <= args.queries < args.length or not 0 <= args.delta <= 1:
        parser.error("--prompts >= 1, 1 <= --queries < --length and 0 <= --delta <= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.perf_counter()
    model, token_ids, versions = load_model(args.model)
    starts = sample_windows(token_ids, args.prompts, args.length)
    sim = None
    for start in tqdm(starts, desc="prompts", unit="prompt"):
        window = torch.tensor([token_ids[start : start + args.length]])
        one = head_similarity(last_queries_attention(model, window, args.queries))
        sim = one if sim is None else sim + one
    sim = kv_head_similarity(sim / len(starts), model.config.num_key_value_heads)
    groups = LayerGroups.of(group_layers(sim, args.delta))
    seconds = time.perf_counter() - started

    pod = PoD()
    print(f"\n{'KV head':>7}  blocks (layers)")
    for head, blocks in enumerate(groups.blocks):
        print(f"{head:>7}  " + " ".join("[" + ",".join(map(str, block)) + "]" for block in blocks))
    saved = {n: pod.saved_fraction(groups, n) for n in (2048, 4096, 8192)}
    print(
        f"\n(layer, head) pairs sharing scores: {groups.shared_fraction():.1%}; K+V saved at "
        + ", ".join(f"{n} tokens {s:.1%}" for n, s in saved.items())
        + f" (n_s {pod.sink_tokens}, n_r {pod.recent_tokens})"
    )

    payload = {
        **provenance("kvpolicy.offline.calibrate_pod", argv, versions),
        "settings": {
            "model": model_label(args.model),
            "prompts": args.prompts,
            "length": args.length,
            "queries": args.queries,
            "delta": args.delta,
            "window_starts": starts,
            "similarity": "1 - Jensen-Shannon divergence (base 2), mean over rows, prompts and each KV head's query heads",
        },
        "seconds": round(seconds, 1),
        "num_layers": groups.num_layers,
        "num_kv_heads": groups.num_heads,
        "blocks": groups.blocks,
        "shared_fraction": groups.shared_fraction(),
        "saved_fraction": {str(n): s for n, s in saved.items()},
        "similarity": [[[round(v, 5) for v in row] for row in head] for head in sim.tolist()],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    plot(args.out.with_suffix(".png"), sim, groups, args.delta)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
