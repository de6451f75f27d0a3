"""Which layers could choose the page that holds a key the output stated: OmniKV's filter layers for recall.

    python benchmarks/filter_layer_recall.py --seed 1   # the tuning prompts; --seed 2: the reported ones

The recall items of ``long_output_quality.py`` (a prompt, then an output that states a key at 0, a quarter or half
of it and asks for it at the end), run once through the full cache in Hugging Face transformers. At the question's
last token, the position whose next token starts the answer, each layer's attention is ranked by page as OmniKV
ranks it in decode (the max over query heads, summed over each page's tokens, eq. 4 of the paper), leaving out the
current page, which is always read. A row per layer: the rank of the key's best page in each item (0: first), its
worst over the items and how many items put it among the pages a budget reads (``--pages`` chosen pages). A filter
layer that ranks it low lets the sparse layers after it read the key; one that ranks it high hides it from them.
Writes ``benchmarks/results/filter_layer_recall_seed{seed}.json`` (``_{selector}`` before ``.json`` for a window
selector), a table and a plot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import RESULTS_DIR, model_folder, write_results  # noqa: E402
from benchmarks.long_output_quality import make_tasks  # noqa: E402
from kvpolicy.policies.omnikv import SELECTORS, page_sums, selector_weights  # noqa: E402

COLUMNS = ["layer", "ranks", "worst", "read"]


def key_positions(item: dict, tokenizer) -> list[int]:
    """Where the key's tokens sit in prompt + output (each place the key is stated)."""
    key = tokenizer(f" {item['key']}", add_special_tokens=False)["input_ids"]
    output, start = item["forced"], len(item["prompt"])
    return [
        start + i + j
        for i in range(len(output) - len(key) + 1)
        if output[i : i + len(key)] == key
        for j in range(len(key))
    ]


def page_ranks(attentions, positions: list[int], page_size: int, selector: str = "last", window: int = 1) -> list[int]:
    """Per layer: the best rank of a page holding ``positions`` among the pages before the current one, ranked by
    the attention of the last ``window`` tokens, max over heads, weighted by ``selector`` (§4.2), summed per page."""
    ranks = []
    for layer in attentions:
        weights = selector_weights(selector, window, layer.device).to(layer.dtype)
        scores = weights @ layer[0, :, -window:, :].amax(dim=0)
        pages = page_sums(scores[None], page_size)[0]
        order = pages[:-1].argsort(descending=True).tolist()
        ranks.append(min(order.index(p) for p in {p // page_size for p in positions} if p < len(order)))
    return ranks


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    layers = [r["layer"] for r in rows]
    for i in range(len(rows[0]["ranks"])):
        ax.plot(layers, [r["ranks"][i] for r in rows], marker=".", alpha=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("rank of the key's page (0: first)")
    ax.set_title("the question's last token: where each layer ranks the page of a key the output stated")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="the recall items' seed (1: tuning, 2: reported)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--pages", type=int, default=7, help="pages a budget reads besides the current one")
    parser.add_argument("--selector", default="last", choices=SELECTORS, help="OmniKV's context selector (§4.2)")
    parser.add_argument("--window", type=int, default=1, help="the selector's observation window (tokens)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    items = make_tasks(tokenizer, args.prompts, args.output_len, args.seed)["recall"]
    per_item = []
    for item in tqdm(items, desc="recall items", unit="item"):
        with torch.no_grad():
            out = model(torch.tensor([item["prompt"] + item["forced"]]), output_attentions=True)
        per_item.append(
            page_ranks(out.attentions, key_positions(item, tokenizer), args.page_size, args.selector, args.window)
        )
    rows = []
    for layer, ranks in enumerate(zip(*per_item)):
        rows.append(
            {"layer": layer, "ranks": list(ranks), "worst": max(ranks), "read": sum(r < args.pages for r in ranks)}
        )
    settings = {
        "seed": args.seed,
        "items": [{"depth": item["depth"], "key": item["key"]} for item in items],
        "page_size": args.page_size,
        "pages_read": args.pages,
        "selector": args.selector,
        "window": args.window,
        "output_len": args.output_len,
        "model": "SmolLM2-135M-Instruct (kvpolicy-model), Hugging Face transformers, eager attention, float32",
    }
    suffix = "" if args.selector == "last" else f"_{args.selector}"
    out = args.out or RESULTS_DIR / f"filter_layer_recall_seed{args.seed}{suffix}.json"
    write_results(out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
