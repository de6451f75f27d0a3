"""Per-op microbenchmarks: each C++ op (csrc/) against the torch code it replaced, same inputs, same run.

    python benchmarks/ops.py            # writes benchmarks/results/ops.json, .md, .png
    python benchmarks/ops.py --quick    # fewer repeats

Each op on the default model's shapes, on a cache laid out as vLLM's CPU writer packs it, against the torch code it
replaced; for the column sums, the GEMM floor any exact implementation spends. Method and columns:
docs/benchmarks.md#c-op-runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

import kvpolicy_csrc  # noqa: E402
from benchmarks.common import RESULTS_DIR, plot_timings, write_results  # noqa: E402
from kvpolicy.policies.h2o import attention_column_sums, new_token_attention  # noqa: E402
from kvpolicy.policies.omnikv import context_scores, page_sums  # noqa: E402
from kvpolicy.vllm.worker.ops.cpu import cpu_geometry, one_head_pages, page_layout  # noqa: E402

KV_HEADS, Q_HEADS, HEAD_SIZE, BLOCK_SIZE = 3, 9, 64, 128
SCALE = 1 / math.sqrt(HEAD_SIZE)
COLUMNS = ["op", "shape", "torch_ms", "csrc_ms", "speedup", "gemm_floor_ms"]
REPEATS = {"quick": 3, "full": 10}


@dataclass(frozen=True)
class Case:
    """One op at one shape: ``setup()`` returns (torch call, C++ call, optional floor call)."""

    op: str
    shape: str
    setup: Callable[[], tuple[Callable, Callable, Callable | None]]


def median_ms(call: Callable, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def paged_cache(blocks: int, seed: int = 0):
    """A random float32 cache in vLLM's CPU page packing, its PageLayout and PageGeometry."""
    cache = torch.randn(blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=torch.Generator().manual_seed(seed))
    layout = page_layout("vec", torch.float32, BLOCK_SIZE, HEAD_SIZE)
    return cache, layout, cpu_geometry(layout, cache)


def column_sums_case(length: int) -> Case:
    def setup():
        keys, queries = torch.randn(KV_HEADS, length, HEAD_SIZE), torch.randn(Q_HEADS, length, HEAD_SIZE)
        expanded = keys.repeat_interleave(Q_HEADS // KV_HEADS, dim=0).transpose(1, 2).contiguous()
        return (
            lambda: attention_column_sums(keys, queries),
            lambda: kvpolicy_csrc.attention_column_sums(keys, queries, SCALE),
            lambda: torch.bmm(queries, expanded),
        )

    return Case("attention_column_sums", f"prompt {length}, 9 query heads", setup)


def new_token_weights_case(requests: int, length: int) -> Case:
    def setup():
        pages = -(-length // BLOCK_SIZE)
        cache, layout, geometry = paged_cache(requests * pages + 1)
        seqs = requests * KV_HEADS
        table = torch.randperm(cache.shape[0] * KV_HEADS)[: seqs * pages].view(seqs, pages)
        lengths = torch.full((seqs,), length, dtype=torch.int32)
        query = torch.randn(requests, Q_HEADS, HEAD_SIZE)
        token_of = torch.arange(requests).repeat_interleave(KV_HEADS)
        head_of = torch.arange(KV_HEADS).repeat(requests)
        by_kv_head = (-1, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_SIZE)

        def torch_path():
            keys = layout.page_keys(one_head_pages(cache), table)
            return new_token_attention(keys, lengths.long(), query.view(by_kv_head)[token_of, head_of])

        args = (query, cache, geometry, token_of, head_of, table, lengths, SCALE, KV_HEADS)
        return torch_path, lambda: kvpolicy_csrc.new_token_weights(*args).double(), None

    return Case("new_token_weights", f"{requests} requests x 3 KV heads, {length} tokens each", setup)


def context_scores_case(rows: int, length: int) -> Case:
    def setup():
        pages = -(-length // BLOCK_SIZE)
        cache, layout, geometry = paged_cache(rows * pages)
        page_ids = torch.randperm(cache.shape[0] * KV_HEADS)[: rows * KV_HEADS * pages].view(rows, KV_HEADS, pages)
        lengths = torch.full((rows,), length, dtype=torch.int64)
        query = torch.randn(rows, Q_HEADS, HEAD_SIZE)
        token_idx = torch.arange(rows)

        def torch_path():
            keys = layout.page_key_blocks(one_head_pages(cache), page_ids)
            scores = context_scores(query[token_idx].view(-1, Q_HEADS, 1, HEAD_SIZE), keys, lengths)
            return page_sums(scores, BLOCK_SIZE)

        args = (query, cache, geometry, token_idx, page_ids, lengths, SCALE)
        return torch_path, lambda: kvpolicy_csrc.context_page_scores(*args), None

    return Case("context_page_scores", f"OmniKV filter layer, batch {rows}, {length} tokens", setup)


def gather_case(tokens: int) -> Case:
    def setup():
        cache, layout, geometry = paged_cache(-(-tokens // BLOCK_SIZE))
        slots = torch.arange(KV_HEADS * tokens)
        pages = one_head_pages(cache).view(-1)
        return lambda: layout.gather(pages, slots), lambda: kvpolicy_csrc.gather_tokens(cache, geometry, slots), None

    return Case("gather_tokens", f"a {tokens}-token prompt, 3 KV heads (relocation read)", setup)


def move_case(tokens: int, kept: int) -> Case:
    def setup():
        cache, layout, geometry = paged_cache(-(-tokens // BLOCK_SIZE))
        generator = torch.Generator().manual_seed(1)
        per_head = [torch.randperm(tokens, generator=generator)[:kept].sort().values for _ in range(KV_HEADS)]
        src = torch.cat([h * tokens + p for h, p in enumerate(per_head)])
        dst = torch.cat([h * tokens + torch.arange(kept) for h in range(KV_HEADS)])
        pages = one_head_pages(cache).view(-1)

        def torch_path():
            keys, values = layout.gather(pages, src)
            layout.scatter(pages, dst, keys, values)

        return torch_path, lambda: kvpolicy_csrc.move_tokens(cache, geometry, src, dst), None

    return Case("move_tokens", f"keep {kept} of {tokens} tokens, 3 KV heads (compaction)", setup)


#: The shapes the engine meets: 4K prompt-end scores, decode at budget 256 (+ a page), OmniKV at 7.6K, relocation.
CASES = [
    column_sums_case(1024),
    column_sums_case(4096),
    new_token_weights_case(5, 384),
    new_token_weights_case(8, 384),
    context_scores_case(4, 7600),
    gather_case(3072),
    move_case(3072, 256),
]


def plot(rows: list[dict], path: Path) -> None:
    series = [("C++ csrc/ (after)", [r["csrc_ms"] for r in rows]), ("torch (before)", [r["torch_ms"] for r in rows])]
    plot_timings(path, [f"{r['op']}\n{r['shape']}" for r in rows], series, "ms per call (median), log scale")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{REPEATS['quick']} repeats instead of {REPEATS['full']}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "ops.json")
    args = parser.parse_args()
    repeats = REPEATS["quick" if args.quick else "full"]
    rows = []
    for case in tqdm(CASES, desc="ops"):
        torch_call, csrc_call, floor_call = case.setup()
        torch_ms, csrc_ms = median_ms(torch_call, repeats), median_ms(csrc_call, repeats)
        floor_ms = median_ms(floor_call, repeats) / 2 if floor_call else None
        rows.append(
            dict(
                op=case.op,
                shape=case.shape,
                torch_ms=torch_ms,
                csrc_ms=csrc_ms,
                speedup=torch_ms / csrc_ms,
                gemm_floor_ms=floor_ms,
            )
        )
    settings = dict(
        repeats=repeats,
        threads=torch.get_num_threads(),
        kv_heads=KV_HEADS,
        q_heads=Q_HEADS,
        head_size=HEAD_SIZE,
        block_size=BLOCK_SIZE,
        dtype="float32",
    )
    write_results(args.out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
