"""Per-kernel GPU benchmark: each Triton kernel (triton_kernels/) beside a torch baseline on the same GPU.

    python benchmarks/gpu_kernels.py            # writes benchmarks/results/gpu_kernels.json, .md, .png
    python benchmarks/gpu_kernels.py --quick    # fewer timing repeats

Needs a CUDA GPU, not vLLM: one attention layer of Llama-3.1-8B on vLLM's GPU page layout, each kernel against torch's
dense baseline on the same lengths; with vLLM's wheel on a Hopper GPU, FlashAttention 3 beside the Triton kernel on the
same one-head pages, the engine's fixed-shape decode call included. Method and columns: docs/benchmarks.md#gpu-kernel-runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

import kvpolicy_triton as kt  # noqa: E402
from benchmarks.common import RESULTS_DIR, plot_timings, write_results  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
GROUP, SCALE = Q_HEADS // KV_HEADS, 1 / math.sqrt(HEAD_SIZE)
#: HBM peak (GB/s) by a substring of the device's name, most specific first (the vendors' data sheets).
PEAK_GBPS = (("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350))
#: The GPU sweep's ``--max-model-len`` (4,096 in, 1,024 out, 128 of slack): what a fixed-shape call's grid is sized for.
MAX_MODEL_LEN = 4096 + 1024 + 128
ELEMENT = torch.tensor([], dtype=DTYPE).element_size()
COLUMNS = [
    "kernel",
    "shape",
    "triton_ms",
    "torch_ms",
    "torch_baseline",
    "speedup",
    "GB/s",
    "% peak",
    "fa3_ms",
    "fa3_kernel_ms",
    "fa3_% peak",
    "fa3_ok",
]
#: Milliseconds of timed calls per case (triton.testing.do_bench's ``rep``).
BENCH_MS = {"quick": 25, "full": 200}
#: Query tokens per KV head at each end of a prompt whose FlashAttention output is checked against the loop reference.
CHECKED_TOKENS = 32


@dataclass(frozen=True)
class Case:
    """One kernel at one shape: ``setup()`` returns (Triton call, torch call, cache bytes touched)."""

    kernel: str
    shape: str
    baseline: str
    setup: Callable[[], Calls | tuple[Callable, Callable, int]]


@dataclass(frozen=True)
class FlashRun:
    """FlashAttention 3's paged varlen forward on a case's pages: ``attend`` gathers the queries into
    one-head order, runs the kernel and scatters the output back (what the engine would run);
    ``kernel`` is the kernel alone; ``check()`` returns its largest error against the loop reference
    and whether that is within the Triton kernel's test tolerance."""

    attend: Callable
    kernel: Callable
    check: Callable[[], tuple[float, bool]]


class Calls(NamedTuple):
    """What a case's ``setup()`` returns: the Triton call, the torch call, the cache bytes the kernel touches
    once and, for prompt rows, FlashAttention 3's run or why it cannot run here."""

    triton: Callable
    torch: Callable
    cache_bytes: int
    flash: FlashRun | str | None = None


def paged(lengths: list[int], seed: int = 0, physical: str = "HND"):
    """A cache whose virtual sequence s (one KV head of one request) holds ``lengths[s]`` tokens on shuffled pages.

    ``physical``: HND allocates each one-head page contiguous, NHD interleaves a block's heads token by
    token (the logical shape is [blocks, kv_heads, block_size, 2 * head_size] either way).
    Returns the cache, its geometry, the page table [S, max pages] of one-head page ids and the lengths.
    """
    pages = [-(-n // BLOCK_SIZE) for n in lengths]
    blocks = -(-sum(pages) // KV_HEADS) + 1
    generator = torch.Generator(device="cuda").manual_seed(seed)
    if physical == "HND":
        cache = torch.randn(blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, device="cuda", generator=generator)
    else:
        cache = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE, device="cuda", generator=generator)
        cache = cache.transpose(1, 2)
    cache = cache.to(DTYPE)
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
        lengths = (
            torch.randint(length // 4, 7 * length // 4, (seqs,), generator=generator).tolist()
            if ragged
            else [length] * seqs
        )
        cache, geom, table, seq_lens = paged(lengths)
        query = torch.randn(requests, Q_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        out = torch.empty_like(query)
        seq = torch.arange(seqs, device="cuda")
        args = (
            seq // KV_HEADS,
            seq % KV_HEADS,
            torch.arange(seqs + 1, device="cuda", dtype=torch.int32),
            seq_lens,
            table,
        )
        k, v = dense_kv(requests, length)
        q = query.unsqueeze(2)
        longest = max(lengths)  # as the engine passes it: from the host
        return Calls(
            lambda: kt.paged_attention(query, out, cache, geom, *args, SCALE, KV_HEADS, 1, longest),
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            2 * sum(lengths) * HEAD_SIZE * ELEMENT,
            flash_run(query, cache, geom, *args, max_query_len=1),
        )

    kept = f"per-head lengths {length // 4}..{7 * length // 4}, mean {length}" if ragged else f"{length} tokens"
    return Case("paged_attention (decode)", f"{requests} requests, {kept}", f"SDPA, dense, {length} tokens", setup)


def flash_run(query, cache, geom, token, head, starts, seq_lens, table, max_query_len, sample=None) -> FlashRun | str:
    """FlashAttention 3 (vLLM's ``vllm.vllm_flash_attn``, ``fa_version=3``) over the same one-head pages,
    its arguments made by kvpolicy's helper from a one-head ``AttentionBatch``; or why it cannot run here.
    ``sample``: the virtual sequences (token, head, starts, lengths, table) whose output is checked against the
    loop reference (default: the call's own)."""
    try:
        from vllm.vllm_flash_attn import fa_version_unsupported_reason, flash_attn_varlen_func

        from kvpolicy.vllm.worker.ops.flash_varlen import flash_pages, flash_varlen_call
        from kvpolicy.vllm.worker.ops.triton import VirtualSequences
        from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows
    except Exception as error:  # a CPU build, no vLLM, or a vLLM that does not load with this torch
        return f"vllm.vllm_flash_attn or kvpolicy's vLLM package is not importable: {error}"
    reason = fa_version_unsupported_reason(3)
    if reason:
        return reason
    from tests.kernels.paging import TOLERANCE

    pages = flash_pages(cache)
    tokens = torch.arange(query.shape[0], device=query.device)
    batch = AttentionBatch(tokens, starts, seq_lens, table, 1, VirtualSequences(max_query_len))
    call = flash_varlen_call(batch, HeadRows(token, head), pages)
    queries = call.queries(query, KV_HEADS)
    result, out = torch.empty_like(queries), torch.empty_like(query)

    def kernel(q=queries):
        flash_attn_varlen_func(
            q,
            pages.key,
            pages.value,
            call.max_seqlen_q,
            call.cu_seqlens_q,
            call.max_seqlen_k,
            seqused_k=call.seqused_k,
            softmax_scale=SCALE,
            causal=True,
            block_table=call.block_table,
            out=result,
            fa_version=3,
        )

    def attend():
        kernel(call.queries(query, KV_HEADS))
        call.write(out, result, KV_HEADS)

    def check() -> tuple[float, bool]:
        attend()
        checked = sample or (token, head, starts, seq_lens, table)
        want = torch.zeros_like(query)
        kt.paged_attention_reference(query, want, cache, geom, *checked, SCALE, KV_HEADS)
        got, expected = [t.unflatten(1, (KV_HEADS, -1))[checked[0], checked[1]].float() for t in (out, want)]
        return float((got - expected).abs().max()), torch.allclose(got, expected, **TOLERANCE[DTYPE])

    return FlashRun(attend, kernel, check)


def prompt_ends(length: int, table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first and last ``CHECKED_TOKENS`` queries of every KV head of one prompt, as virtual sequences (the
    prefix, then the whole prompt): what a prompt row checks of FlashAttention's output."""
    device = table.device
    ends = torch.cat([torch.arange(CHECKED_TOKENS), torch.arange(length - CHECKED_TOKENS, length)]).to(device)
    kv = torch.arange(KV_HEADS, device=device)
    token, head = ends.repeat(KV_HEADS), kv.repeat_interleave(2 * CHECKED_TOKENS)
    starts = torch.arange(2 * KV_HEADS + 1, device=device) * CHECKED_TOKENS
    prefix_and_whole = torch.tensor([CHECKED_TOKENS, length], device=device).repeat(KV_HEADS)
    return token, head, starts, prefix_and_whole, table.repeat_interleave(2, dim=0)


def prefill_case(length: int, physical: str = "HND") -> Case:
    """A whole prompt as one causal chunk: the path a compressing request's prompt takes."""

    def setup():
        cache, geom, table, seq_lens = paged([length] * KV_HEADS, physical=physical)
        query = torch.randn(length, Q_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        out = torch.empty_like(query)
        token = torch.arange(length, device="cuda").repeat(KV_HEADS)
        head = torch.arange(KV_HEADS, device="cuda").repeat_interleave(length)
        starts = torch.arange(KV_HEADS + 1, device="cuda", dtype=torch.int32) * length
        args = (token, head, starts, seq_lens, table)
        k, v = dense_kv(1, length)
        q = query.transpose(0, 1).unsqueeze(0)
        return Calls(
            lambda: kt.paged_attention(query, out, cache, geom, *args, SCALE, KV_HEADS, length, length),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            2 * KV_HEADS * length * HEAD_SIZE * ELEMENT,
            flash_run(query, cache, geom, *args, max_query_len=length, sample=prompt_ends(length, table)),
        )

    shape = f"1 prompt of {length} tokens" + ("" if physical == "HND" else f", {physical} cache")
    return Case("paged_attention (prefill)", shape, "SDPA causal, dense", setup)


def fixed_decode_case(requests: int, rows: int, physical: str = "HND") -> Case:
    """The engine's fixed-shape decode call (``modes/fixed_decode.py``) of ``requests`` Ada-SnapKV requests at
    budget 1,024 halfway through 1,024 output tokens (each KV head's kept count between 256 and 1,792, plus 512),
    the batch padded to a CUDA graph's ``rows`` with sequences 0 keys long: kvpolicy's kernel as ``TritonOps``
    launches it (grid for ``MAX_MODEL_LEN``, the split decode's workspace), FlashAttention 3 through
    ``TritonOps.attend`` over the same int32 buffers (the buffers' views, ``FIXED_SPLITS``)."""

    def setup():
        generator = torch.Generator().manual_seed(4)
        kept = torch.randint(256, 1793, (requests * KV_HEADS,), generator=generator) + 512
        lengths = kept.tolist() + [0] * ((rows - requests) * KV_HEADS)
        cache, geom, table, seq_lens = paged(lengths, physical=physical)
        sequences = rows * KV_HEADS
        width = -(-MAX_MODEL_LEN // BLOCK_SIZE)
        tables = torch.zeros(sequences, width, dtype=torch.int32, device="cuda")
        tables[:, : table.shape[1]] = table
        virtual = torch.arange(sequences, device="cuda")
        token_of, head_of = virtual // KV_HEADS, virtual % KV_HEADS
        starts = torch.arange(sequences + 1, dtype=torch.int32, device="cuda")
        query = torch.randn(rows, Q_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        out = torch.empty_like(query)
        workspace = kt.decode_workspace(kt.TARGET_PROGRAMS, GROUP, HEAD_SIZE, "cuda")
        buffers = (token_of, head_of, starts, seq_lens, tables)
        k, v = dense_kv(requests, int(kept.float().mean()))
        q = query[:requests].unsqueeze(2)
        return Calls(
            lambda: kt.paged_attention(query, out, cache, geom, *buffers, SCALE, KV_HEADS, 1, MAX_MODEL_LEN, workspace),
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            2 * sum(lengths) * HEAD_SIZE * ELEMENT,
            flash_fixed_run(query, cache, geom, buffers, requests),
        )

    padding = f", padded to {rows}" if rows > requests else ""
    shape = f"{requests} requests{padding}, kept 768..2304 per head, grid for {MAX_MODEL_LEN}, {physical}"
    return Case("paged_attention (fixed-shape decode)", shape, "SDPA, dense, the mean length", setup)


def flash_fixed_run(query, cache, geom, buffers, requests: int) -> FlashRun | str:
    """FlashAttention 3 as the engine calls it in a fixed-shape decode step: ``TritonOps.attend`` over the
    buffers, with the plan ``TritonOps.fixed_decode_plan`` makes; or why it cannot run here."""
    try:
        from kvpolicy.vllm.worker.ops.triton import TritonOps
        from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows
    except Exception as error:  # a CPU build, no vLLM, or a vLLM that does not load with this torch
        return f"kvpolicy's vLLM package is not importable: {error}"
    from tests.kernels.paging import TOLERANCE

    ops = TritonOps()
    if ops.flash is None:
        return "vLLM's FlashAttention 3 does not serve this device (kvpolicy logs why)"
    token_of, head_of, starts, seq_lens, tables = buffers
    sequences, rows = token_of.numel(), query.shape[0]
    plan = ops.fixed_decode_plan(sequences, MAX_MODEL_LEN, GROUP, HEAD_SIZE, query.device)
    batch = AttentionBatch(torch.arange(rows), starts, seq_lens, tables, 1, plan)
    layer = SimpleNamespace(
        impl=SimpleNamespace(scale=SCALE, num_kv_heads=KV_HEADS, num_queries_per_kv=GROUP, head_size=HEAD_SIZE)
    )
    out = torch.empty_like(query)
    rows_of = HeadRows(token_of, head_of, whole_batch=True)

    def attend():
        ops.attend(layer, query, out, cache, batch, rows_of)

    def check() -> tuple[float, bool]:
        attend()
        real = slice(0, requests * KV_HEADS)
        checked = (token_of[real], head_of[real], starts[: requests * KV_HEADS + 1], seq_lens[real], tables[real])
        want = torch.zeros_like(query)
        kt.paged_attention_reference(query, want, cache, geom, *checked, SCALE, KV_HEADS)
        got, expected = out[:requests].float(), want[:requests].float()
        padded_zero = bool((out[requests:] == 0).all())
        return float((got - expected).abs().max()), padded_zero and torch.allclose(got, expected, **TOLERANCE[DTYPE])

    return FlashRun(attend, attend, check)


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
            lambda: kt.new_token_weights(
                query, cache, geom, seq // KV_HEADS, seq % KV_HEADS, table, seq_lens, SCALE, KV_HEADS
            ),
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
        positions = torch.stack(
            [torch.randperm(length, generator=generator)[:kept].sort().values for _ in range(KV_HEADS)]
        ).cuda()
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
    fixed_decode_case(8, 8),
    fixed_decode_case(6, 8),
    fixed_decode_case(16, 16),
    fixed_decode_case(8, 8, physical="NHD"),
    prefill_case(4096),
    prefill_case(4096, physical="NHD"),
    new_token_weights_case(16, 1024),
    context_scores_case(16, 32768),
    window_scores_case(32768),
    keydiff_scores_case(32768),
    write_slots_case(64),
    move_case(32768, 2048),
]


def peak_gbps(device: str) -> int | None:
    """The HBM peak of a device named ``device`` (``PEAK_GBPS``), None for one not listed."""
    return next((peak for name, peak in PEAK_GBPS if name in device), None)


def plot(rows: list[dict], path: Path) -> None:
    series = [
        ("kvpolicy Triton kernel", [r["triton_ms"] for r in rows]),
        ("torch baseline", [r["torch_ms"] for r in rows]),
    ]
    if any(r.get("fa3_ms") for r in rows):
        series.append(("FlashAttention 3, paged varlen", [r.get("fa3_ms") or math.nan for r in rows]))
    plot_timings(
        path,
        [f"{r['kernel']}\n{r['shape']}" for r in rows],
        series,
        "ms per call (median, CUDA events), log scale",
        torch.cuda.get_device_name(),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{BENCH_MS['quick']} ms of timed calls per case instead of {BENCH_MS['full']}",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_kernels.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py times Triton kernels on a CUDA GPU; none is visible here")
    from triton.testing import do_bench

    bench_ms = BENCH_MS["quick" if args.quick else "full"]
    peak = peak_gbps(torch.cuda.get_device_name())
    rows, flash_skipped = [], {}
    for case in tqdm(CASES, desc="kernels"):
        calls = Calls(*case.setup())
        triton_ms = do_bench(calls.triton, rep=bench_ms, return_mode="median")
        torch_ms = do_bench(calls.torch, rep=bench_ms, return_mode="median")
        gbps = calls.cache_bytes / triton_ms / 1e6
        row = {
            "kernel": case.kernel,
            "shape": case.shape,
            "triton_ms": triton_ms,
            "torch_ms": torch_ms,
            "torch_baseline": case.baseline,
            "speedup": torch_ms / triton_ms,
            "GB/s": gbps,
            "% peak": 100 * gbps / peak if peak else None,
        }
        flash = calls.flash
        if isinstance(flash, FlashRun):
            try:
                max_error, ok = flash.check()
                kernel_ms = do_bench(flash.kernel, rep=bench_ms, return_mode="median")
                row.update(
                    fa3_ms=do_bench(flash.attend, rep=bench_ms, return_mode="median"),
                    fa3_kernel_ms=kernel_ms,
                    fa3_ok=ok,
                    fa3_max_error=max_error,
                )
                row["fa3_% peak"] = 100 * calls.cache_bytes / kernel_ms / 1e6 / peak if peak else None
            except RuntimeError as error:  # FlashAttention's own argument checks refusing the call
                flash = f"the call failed: {error}"
        if isinstance(flash, str):
            flash_skipped[f"{case.kernel}, {case.shape}"] = flash
            tqdm.write(f"{case.kernel}, {case.shape}: FlashAttention 3 skipped: {flash}")
        rows.append(row)
        torch.cuda.empty_cache()
    settings = dict(
        gpu=torch.cuda.get_device_name(),
        timing_ms_per_case=bench_ms,
        q_heads=Q_HEADS,
        kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        block_size=BLOCK_SIZE,
        dtype="bfloat16",
        peak_gbps=peak,
        max_model_len=MAX_MODEL_LEN,
        fa3_checked_tokens_per_end=CHECKED_TOKENS,
        fa3_skipped=flash_skipped,
    )
    write_results(args.out, settings, rows, COLUMNS, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
