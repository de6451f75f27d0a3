"""Post-train a model for PoD's sharing pattern (§2.2), on the essays, with transformers on CPU.

    python -m kvpolicy.offline.train_pod [--model PATH] [--groups PATH] [--out DIR] [--steps N] [--length TOKENS]
                                 [--sink-tokens N] [--recent-tokens N] [--lr X] [--save-every N]

The paper post-trains the model with the sharing in place so that it learns to live with it. The training forward is
eq. 3-4 at every position at once (Figure 2-②'s masked form), a transformers attention function (``SharedAttention``)
whose distant logits come, with their gradients, from the block's lowest layer, so the weights stay a plain
LlamaForCausalLM that vLLM serves. Data, schedule, outputs and what it did: docs/policies.md#pod. Paper: *Compressing
KV Cache for Long-Context LLM Inference with Inter-Layer Attention Similarity*, arXiv:2412.02252.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvpolicy.offline.calibrate import add_model_arguments, load_model, model_label, provenance, sample_windows
from kvpolicy.offline.model import MODEL_NAME, default_model_dir, prepare
from kvpolicy.policies.pod import DEFAULT_GROUPS, LayerGroups

ATTENTION_NAME = "pod_sharing"
CHECKPOINT = "checkpoint.pt"
TRAIN_LOG = "train_log.json"
WINDOW_SEED = 0
DEFAULT_OUT = default_model_dir().with_name(f"{MODEL_NAME}-pod")


class SharedAttention:
    """Eq. 3-4 as a transformers attention function for one model's grouping.

    Within one forward, each lowest layer leaves in ``stored`` the logits of the
    KV heads that a layer above reuses; layers run in order, so they are there
    when read. A forward starts at layer 0, which drops the previous forward's.
    """

    def __init__(self, groups: LayerGroups, sink_tokens: int, recent_tokens: int):
        self.lowest = groups.lowest()
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.reused = groups.reused()
        self.stored: dict[tuple[int, int], torch.Tensor] = {}

    def masks(self, queries: int, keys: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(causal, distant), [queries, keys] each: the queries are the last ``queries`` of ``keys`` positions."""
        t = torch.arange(keys - queries, keys, device=device)[:, None]
        j = torch.arange(keys, device=device)[None, :]
        causal = j <= t
        return causal, causal & (j >= self.sink_tokens) & (t - j >= self.recent_tokens)

    def __call__(self, module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
        """Like transformers' eager attention (query [B, Hq, T, D], key/value [B, Hkv, S, D]), batch without padding:
        the causal mask is built here from positions, and ``attention_mask`` is not used."""
        layer = module.layer_idx
        if layer == 0:
            self.stored.clear()
        batch, heads, queries, dim = query.shape
        kv_heads, keys = key.shape[1], key.shape[2]
        grouped = query.view(batch, kv_heads, heads // kv_heads, queries, dim)
        causal, distant = self.masks(queries, keys, query.device)
        per_head = []
        for head, low in enumerate(self.lowest[layer]):
            # [B, query heads of this KV head, T, S], a tensor of its own so that storing it keeps no other head's.
            own = (grouped[:, head] @ key[:, head, None].transpose(-1, -2)) * scaling
            if (layer, head) in self.reused:
                self.stored[layer, head] = own
            per_head.append(own if low == layer else torch.where(distant, self.stored[low, head], own))
        shared = torch.stack(per_head, dim=1).masked_fill(~causal, float("-inf"))
        weights = shared.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
        output = weights @ value[:, :, None]
        return output.flatten(1, 2).transpose(1, 2).contiguous(), weights.flatten(1, 2)


def use_sharing(model, sharing: SharedAttention | None) -> None:
    """Run ``model`` with PoD's sharing (``sharing``), or with plain eager attention (None)."""
    if sharing is not None:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, sharing)
    model.set_attn_implementation(ATTENTION_NAME if sharing is not None else "eager")


@torch.no_grad()
def held_out_loss(model, sharing: SharedAttention, window: torch.Tensor) -> dict[str, float]:
    """Next-token loss on ``window`` [1, n] with full attention and with sharing; leaves sharing on."""
    losses = {}
    for name, attention in (("full_attention", None), ("sharing", sharing)):
        use_sharing(model, attention)
        losses[name] = model(window, labels=window).loss.item()
    return losses


def cosine_lr(lr: float, step: int, steps: int) -> float:
    return lr * 0.5 * (1 + math.cos(math.pi * step / steps))


def train(model, windows: list[torch.Tensor], out: Path, lr: float, save_every: int, log: dict) -> dict:
    """One AdamW step per window [1, n], resuming from ``out``'s checkpoint when there is one (made with
    ``log``'s settings; its log then replaces ``log``); saves it every ``save_every`` steps and at the end.
    Returns the log."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    checkpoint = out / CHECKPOINT
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        if saved["log"].get("settings") != log.get("settings"):
            raise SystemExit(f"{checkpoint} was made with other settings: rerun its command or pick another --out")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        log = saved["log"]
    out.mkdir(parents=True, exist_ok=True)
    start = len(log["steps"])
    model.train()
    progress = tqdm(range(start, len(windows)), desc="train", unit="step", initial=start, total=len(windows))
    for step in progress:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(lr, step, len(windows))
        loss = model(windows[step], labels=windows[step]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log["steps"].append(
            {
                "step": step + 1,
                "loss": loss.item(),
                "lr": optimizer.param_groups[0]["lr"],
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
        progress.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % save_every == 0 or step + 1 == len(windows):
            save_checkpoint(checkpoint, model, optimizer, log)
    model.eval()
    return log


def save_checkpoint(path: Path, model, optimizer, log: dict) -> None:
    """Written beside and then renamed, so that an interrupted save leaves the previous checkpoint whole."""
    partial = path.with_suffix(".partial")
    torch.save(
        {"step": len(log["steps"]), "model": model.state_dict(), "optimizer": optimizer.state_dict(), "log": log},
        partial,
    )
    partial.replace(path)
    (path.parent / TRAIN_LOG).write_text(json.dumps(log, indent=1))


def export(model, out: Path, tokenizer_source: Path | None = None) -> None:
    """An HF folder vLLM serves as is: the plain architecture (sharing is only how it was trained) and the tokenizer."""
    use_sharing(model, None)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_source is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvpolicy.offline.train_pod", description=__doc__.split("\n")[0])
    add_model_arguments(parser, length=1024)
    parser.add_argument(
        "--groups",
        type=Path,
        default=DEFAULT_GROUPS,
        help=f"grouping JSON from calibrate_pod (default {DEFAULT_GROUPS})",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output HF folder, checkpoint and log (default {DEFAULT_OUT})"
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps, one window each (default 200)")
    parser.add_argument(
        "--sink-tokens", type=int, default=16, help="n_s, initial proximal tokens (default 16, the paper's)"
    )
    parser.add_argument(
        "--recent-tokens", type=int, default=128, help="n_r, recent proximal tokens (default 128; the paper's 4080)"
    )
    parser.add_argument(
        "--lr", type=float, default=1e-5, help="peak AdamW learning rate, cosine to 0 (default 1e-5, the paper's)"
    )
    parser.add_argument("--save-every", type=int, default=20, help="steps between checkpoints (default 20)")
    args = parser.parse_args(argv)
    if (
        args.steps < 1
        or args.length < 2
        or args.sink_tokens < 0
        or args.recent_tokens < 1
        or args.lr <= 0
        or args.save_every < 1
    ):
        parser.error("--steps, --recent-tokens, --save-every >= 1, --length >= 2, --sink-tokens >= 0 and --lr > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.perf_counter()
    model_path = args.model or prepare()
    model, token_ids, versions = load_model(model_path)
    groups = LayerGroups.load(args.groups)
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    if (groups.num_layers, groups.num_heads) != shape:
        raise SystemExit(
            f"{args.groups} groups {groups.num_layers} layers x {groups.num_heads} KV heads; the model has {shape[0]} x {shape[1]}"
        )
    sharing = SharedAttention(groups, args.sink_tokens, args.recent_tokens)

    held_out = torch.tensor([token_ids[-args.length :]])
    starts = sample_windows(token_ids[: -args.length], args.steps, args.length)
    random.Random(WINDOW_SEED).shuffle(starts)
    windows = [torch.tensor([token_ids[start : start + args.length]]) for start in starts]

    log = {
        **provenance("kvpolicy.offline.train_pod", argv, versions),
        "settings": {
            "model": model_label(args.model),
            "groups": str(args.groups),
            "steps": args.steps,
            "length": args.length,
            "sink_tokens": args.sink_tokens,
            "recent_tokens": args.recent_tokens,
            "lr": args.lr,
            "schedule": "AdamW, cosine from lr to 0, batch 1",
            "window_starts": starts,
            "held_out": f"the last {args.length} tokens of the essays",
        },
        "steps": [],
    }
    if not (args.out / CHECKPOINT).exists():
        log["before"] = held_out_loss(model, sharing, held_out)
    use_sharing(model, sharing)
    log = train(model, windows, args.out, args.lr, args.save_every, log)
    log["after"] = held_out_loss(model, sharing, held_out)
    export(model, args.out, model_path)
    log["seconds"] = round(time.perf_counter() - started, 1)
    (args.out / TRAIN_LOG).write_text(json.dumps(log, indent=1))

    for when in ("before", "after"):
        print(
            f"held-out loss {when}: full attention {log[when]['full_attention']:.4f}, with sharing {log[when]['sharing']:.4f}"
        )
    per_step = [step["seconds"] for step in log["steps"]]
    print(f"wrote {args.out} ({len(per_step)} steps, {sum(per_step) / len(per_step):.1f} s/step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
