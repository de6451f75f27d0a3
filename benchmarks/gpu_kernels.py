"""Per-kernel GPU benchmark: each Triton kernel (triton_kernels/) beside a torch baseline on the same GPU.

    python benchmarks/gpu_kernels.py            # writes benchmarks/results/gpu_kernels.json, .md, .png
    python benchmarks/gpu_kernels.py --quick    # fewer timing repeats

Needs a CUDA GPU (vLLM is not needed: the kernels and their baselines are
plain torch and Triton). Shapes are one attention layer of Llama-3.1-8B
(32 query heads over 8 KV heads, head size 128, bfloat16) on vLLM's GPU page
layout ``[blocks, kv_heads, 16, 2 * 128]``, pages of one KV head handed out in
shuffled order as the engine's page tables do. ``torch_ms`` is the baseline a
GPU user would otherwise run: torch's fused SDPA (FlashAttention) over dense
contiguous K/V of the same lengths for attention, the same math in dense
torch for the scores, advanced indexing for the copies. ``GB/s`` counts the
cache bytes a kernel must read or write once; ``% peak`` is against the
H100's 3.35 TB/s HBM3.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvpolicy_triton as kt  # noqa: E402
from benchmarks.common import RESULTS_DIR, plot_timings, write_results  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
GROUP, SCALE = Q_HEADS // KV_HEADS, 1 / math.sqrt(HEAD_SIZE)
PEAK_GBPS = 3350
ELEMENT = torch.tensor([], dtype=DTYPE).element_size()
COLUMNS = ["kernel", "shape", "triton_ms", "torch_ms", "torch_baseline", "speedup", "GB/s", "% peak"]
#: Milliseconds of timed calls per case (triton.testing.do_bench's ``rep``).
BENCH_MS = {"quick": 25, "full": 200}


@dataclass(frozen=True)
class Case:
    """One kernel at one shape: ``setup()`` returns (Triton call, torch call, cache bytes touched)."""

    kernel: str
    shape: str
    baseline: str
    setup: Callable[[], tuple[Callable, Callable, int]]


def paged(lengths: list[int], seed: int = 0):
    """A cache whose virtual sequence s (one KV head of one request) holds ``lengths[s]`` tokens on shuffled pages.

    Returns the cache, its geometry, the page table [S, max pages] of one-head page ids and the lengths.
    """
    pages = [-(-n // BLOCK_SIZE) for n in lengths]
    blocks = -(-sum(pages) // KV_HEADS) + 1
    generator = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, device="cuda", generator=generator).to(DTYPE)
    pool = torch.randperm(blocks * KV_HEADS, device="cuda", generator=generator)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int64, device="cuda")
    start = 0
    for s, count in enumerate(pages):
        table[s, :count] = pool[start : start + count]
        start += count
    return cache, kt.PageGeometry.head_major(cache), table, torch.tensor(lengths, dtype=torch.int32, device="cuda")


def dense_kv(requests: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (requests, KV_HEADS, length, HEAD_SIZE)
    return torch.randn(shape, device="cuda", dtype=DTYPE), torch.randn(shape, device="cuda", dtype=DTYPE)


def decode_case(requests: int, length: int, ragged: bool = False) -> Case:
    """One new token per request over every KV head's pages: the decode step of a per-head (Ada-KV) batch."""

    def setup():
        seqs = requests * KV_HEADS
        generator = torch.Generator().manual_seed(1)
        lengths = (torch.randint(length // 4, 7 * length // 4, (seqs,), generator=generator).tolist()
                   if ragged else [length] * seqs)
        cache, geom, table, seq_lens = paged(lengths)
        query = torch.randn(requests, Q_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        out = torch.empty_like(query)
        seq = torch.arange(seqs, device="cuda")
        args = (seq // KV_HEADS, seq % KV_HEADS, torch.arange(seqs + 1, device="cuda"), seq_lens, table)
        k, v = dense_kv(requests, length)
        q = query.unsqueeze(2)
        return (
            lambda: kt.paged_attention(query, out, cache, geom, *args, SCALE, KV_HEADS),
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            2 * sum(lengths) * HEAD_SIZE * ELEMENT,
        )

    kept = f"per-head lengths {length // 4}..{7 * length // 4}, mean {length}" if ragged else f"{length} tokens"
    return Case("paged_attention (decode)", f"{requests} requests, {kept}", f"SDPA, dense, {length} tokens", setup)


def prefill_case(length: int) -> Case:
    """A whole prompt as one causal chunk: the path a compressing request's prompt takes."""

    def setup():
        cache, geom, table, seq_lens = paged([length] * KV_HEADS)
        query = torch.randn(length, Q_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        out = torch.empty_like(query)
        token = torch.arange(length, device="cuda").repeat(KV_HEADS)
        head = torch.arange(KV_HEADS, device="cuda").repeat_interleave(length)
        starts = torch.arange(KV_HEADS + 1, device="cuda") * length
        args = (token, head, starts, seq_lens, table)
        k, v = dense_kv(1, length)
        q = query.transpose(0, 1).unsqueeze(0)
        return (
            lambda: kt.paged_attention(query, out, cache, geom, *args, SCALE, KV_HEADS),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            2 * KV_HEADS * length * HEAD_SIZE * ELEMENT,
        )

    return Case("paged_attention (prefill)", f"1 prompt of {length} tokens", "SDPA causal, dense", setup)


def dense_weights(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[requests, Q_HEADS, n] softmax weights of each request's one query over its dense keys."""
    logits = torch.einsum("rkgd,rknd->rkgn", query.view(-1, KV_HEADS, GROUP, HEAD_SIZE), keys) * SCALE
    return logits.float().softmax(dim=-1).flatten(1, 2)


def new_token_weights_case(requests: int, length: int) -> Case:
    """H2O/D2O's per-step scores: the new token's weights over each KV head's kept tokens, group-averaged."""

    def setup():
        cache, geom, table, seq_lens = paged([length] * requests * KV_HEADS)
        query = torch.randn(requests, Q_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        seq = torch.arange(requests * KV_HEADS, device="cuda")
        keys, _ = dense_kv(requests, length)
        return (
            lambda: kt.new_token_weights(query, cache, geom, seq // KV_HEADS, seq % KV_HEADS, table, seq_lens,
                                         SCALE, KV_HEADS),
            lambda: dense_weights(query, keys).view(requests, KV_HEADS, GROUP, -1).mean(dim=2),
            requests * KV_HEADS * length * HEAD_SIZE * ELEMENT,
        )

    return Case("new_token_weights", f"{requests} requests, {length} tokens per KV head", "dense torch", setup)


def context_scores_case(requests: int, length: int) -> Case:
    """OmniKV's filter layer: every context token's largest weight over the last token's query heads."""

    def setup():
        cache, geom, table, _ = paged([length] * requests * KV_HEADS)
        page_ids = table.view(requests, KV_HEADS, -1)
        query = torch.randn(requests, Q_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        lengths = torch.full((requests,), length, device="cuda", dtype=torch.int64)
        rows = torch.arange(requests, device="cuda")
        keys, _ = dense_kv(requests, length)
        return (
            lambda: kt.context_token_scores(query, cache, geom, rows, page_ids, lengths, SCALE),
            lambda: dense_weights(query, keys).amax(dim=1),
            requests * KV_HEADS * length * HEAD_SIZE * ELEMENT,
        )

    return Case("context_token_scores", f"batch {requests}, {length} tokens", "dense torch", setup)


def window_scores_case(length: int, window: int = 32) -> Case:
    """SnapKV's prompt-end scores: the last ``window`` queries' weights on the prefix, pooled, group-averaged."""

    def setup():
        keys = torch.randn(KV_HEADS, length, HEAD_SIZE, device="cuda", dtype=DTYPE)
        queries = torch.randn(Q_HEADS, window, HEAD_SIZE, device="cuda", dtype=DTYPE)
        causal = torch.ones(window, window, device="cuda", dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(window, length - window, device="cuda", dtype=torch.bool), causal], dim=1)

        def dense():
            expanded = keys.repeat_interleave(GROUP, dim=0)
            logits = (queries @ expanded.transpose(1, 2)).float() * SCALE
            weights = logits.masked_fill_(~mask, float("-inf")).softmax(dim=-1)[..., : length - window].sum(dim=1)
            pooled = F.avg_pool1d(weights.unsqueeze(1), 7, stride=1, padding=3).squeeze(1)
            return pooled.view(KV_HEADS, GROUP, -1).mean(dim=1)

        return lambda: kt.window_scores(keys, queries, 7), dense, KV_HEADS * length * HEAD_SIZE * ELEMENT

    return Case("window_scores", f"prompt {length}, window {window}", "dense torch", setup)


def keydiff_scores_case(length: int) -> Case:
    def setup():
        keys = torch.randn(KV_HEADS, length, HEAD_SIZE, device="cuda", dtype=DTYPE)

        def dense():
            unit = F.normalize(keys.float(), dim=-1)
            return -(unit * F.normalize(unit.mean(dim=1, keepdim=True), dim=-1)).sum(dim=-1)

        return lambda: kt.keydiff_scores(keys), dense, KV_HEADS * length * HEAD_SIZE * ELEMENT

    return Case("keydiff_scores", f"prompt {length}", "dense torch", setup)


def write_slots_case(requests: int) -> Case:
    """The decode step's cache write: one new token per (request, KV head), each to its own head's page."""

    def setup():
        cache, geom, table, _ = paged([BLOCK_SIZE] * requests * KV_HEADS)
        key = torch.randn(requests, KV_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        value = torch.randn_like(key)
        seq = torch.arange(requests * KV_HEADS, device="cuda")
        args = (seq // KV_HEADS, seq % KV_HEADS, table[:, 0] * BLOCK_SIZE + BLOCK_SIZE - 1)
        return (
            lambda: kt.write_slots(cache, geom, key, value, *args),
            lambda: kt.write_slots_reference(cache, geom, key, value, *args),
            2 * requests * KV_HEADS * HEAD_SIZE * ELEMENT,
        )

    return Case("write_slots", f"{requests} requests x {KV_HEADS} KV heads", "advanced indexing", setup)


def move_case(length: int, kept: int) -> Case:
    """Compaction after prompt-end eviction: each KV head's kept tokens moved to the front of its pages."""

    def setup():
        cache, geom, table, _ = paged([length] * KV_HEADS)
        generator = torch.Generator().manual_seed(2)
        positions = torch.stack([torch.randperm(length, generator=generator)[:kept].sort().values
                                 for _ in range(KV_HEADS)]).cuda()
        slot = lambda p: (table.gather(1, p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE).flatten()  # noqa: E731
        src, dst = slot(positions), slot(torch.arange(kept, device="cuda").expand(KV_HEADS, -1))
        return (
            lambda: kt.move_tokens(cache, geom, src, dst),
            lambda: kt.move_tokens_reference(cache, geom, src, dst),
            2 * 2 * KV_HEADS * kept * HEAD_SIZE * ELEMENT,
        )

    return Case("move_tokens", f"keep {kept} of {length} tokens per KV head", "advanced indexing", setup)


#: Decode at growing context and batch, compressed decode, a prompt, and each policy kernel at a long context.
CASES = [
    decode_case(16, 4096),
    decode_case(16, 16384),
    decode_case(64, 4096),
    decode_case(16, 1024, ragged=True),
    prefill_case(4096),
    new_token_weights_case(16, 1024),
    context_scores_case(16, 32768),
    window_scores_case(32768),
    keydiff_scores_case(32768),
    write_slots_case(64),
    move_case(32768, 2048),
]


def plot(rows: list[dict], path: Path) -> None:
    series = [("kvpolicy Triton kernel", [r["triton_ms"] for r in rows]), ("torch baseline", [r["torch_ms"] for r in rows])]
    plot_timings(path, [f"{r['kernel']}\n{r['shape']}" for r in rows], series,
                 "ms per call (median, CUDA events), log scale", torch.cuda.get_device_name())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{BENCH_MS['quick']} ms of timed calls per case instead of {BENCH_MS['full']}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_kernels.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py times Triton kernels on a CUDA GPU; none is visible here")
    from triton.testing import do_bench

    bench_ms = BENCH_MS["quick" if args.quick else "full"]
    rows = []
    for case in tqdm(CASES, desc="kernels"):
        triton_call, torch_call, cache_bytes = case.setup()
        triton_ms = do_bench(triton_call, rep=bench_ms, return_mode="median")
        torch_ms = do_bench(torch_call, rep=bench_ms, return_mode="median")
        gbps = cache_bytes / triton_ms / 1e6
        rows.append({"kernel": case.kernel, "shape": case.shape, "triton_ms": triton_ms, "torch_ms": torch_ms,
                     "torch_baseline": case.baseline, "speedup": torch_ms / triton_ms, "GB/s": gbps,
                     "% peak": 100 * gbps / PEAK_GBPS})
        torch.cuda.empty_cache()
    settings = dict(gpu=torch.cuda.get_device_name(), timing_ms_per_case=bench_ms, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                    head_size=HEAD_SIZE, block_size=BLOCK_SIZE, dtype="bfloat16", peak_gbps=PEAK_GBPS)
    write_results(args.out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
