"""Load test: many concurrent OpenAI-client requests against a real kvpolicy server, good and bad, some aborted.

    python benchmarks/load.py --quick           # 24 requests, 8 at a time, 25% bad inputs
    python benchmarks/load.py                   # 1,000 requests, 16 at a time
    python benchmarks/load.py --url http://127.0.0.1:8000   # a server already running (`make serve`)
    python benchmarks/load.py --dashboard       # also scrape with a real Prometheus and plot the dashboard's panels
    python benchmarks/load.py --long            # short prompts, 256-1,536 output tokens, a pool that preempts

Without ``--url`` it starts ``vllm serve --kv-policy adasnap --kv-budget 256`` on loopback (``--long``:
``adamix``, and a KV pool that holds four of its requests uncompressed). A seeded mix of lengths, streaming,
per-request options, client aborts and bad inputs (each a 400); then the KV pool must be empty and the server
answering. Writes ``benchmarks/results/load.json``, a table and a plot; the mix: docs/operations.md#the-load-test.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import RESULTS_DIR, TOKEN_BYTES, haystack_prompts, write_results  # noqa: E402
from benchmarks.server import scrape, vllm_server  # noqa: E402

SERVED_NAME = "smollm2"
SERVER_ARGS = [
    "--served-model-name",
    SERVED_NAME,
    "--dtype",
    "float32",
    "--max-model-len",
    "4096",
    "--kv-policy",
    "adasnap",
    "--kv-budget",
    "256",
]
MAX_MODEL_LEN = 4096
#: Prompt tokens -> share of the prompts: mostly short, as chat traffic is; every length is over the 256 budget.
PROMPT_LENGTHS = ((300, 0.5), (800, 0.35), (2000, 0.15))
#: The prompt a bad input sends (its options, not its length, make it bad).
BAD_PROMPT_LEN = 300
#: The long-output preset: prompts within the budget (compressed only once decode takes them past it) and some over.
LONG_PROMPT_LENGTHS = ((200, 0.75), (800, 0.25))
#: The long preset's server: adamix, and a pool of 48 blocks: four requests of 200 + 1,536 tokens.
LONG_SERVER_ARGS = [
    *SERVER_ARGS[: SERVER_ARGS.index("--kv-policy")],
    "--kv-policy",
    "adamix",
    "--kv-budget",
    "256",
    "--kv-cache-memory-bytes",
    str(48 * 128 * TOKEN_BYTES),
]
#: Each bad input: the ``vllm_xargs`` or prompt it sends, and what the 400 must say.
BAD_INPUTS = [
    ({"kv_budgt": 128}, "unknown request option 'kv_budgt'"),
    ({"kv_policy": "keydiff"}, "cannot be served"),
    ({"kv_policy": "fastkv"}, "fastkv"),
    ({"kv_budget": -1}, "kv_budget must be a positive integer"),
    ({"kv_budget": "abc"}, "kv_budget must be a positive integer"),
    ({"kv_budget": 10**9}, "larger than the context limit"),
    ("oversized", "maximum context length"),
]
GOOD_OPTIONS = (None, {"kv_budget": 64}, {"kv_budget": 512}, {"kv_policy": "none"}, {"kv_policy": "snapkv"}, None)
#: Long outputs: another budget, a request kept whole in decode, another policy that compresses in decode.
LONG_OPTIONS = (None, None, {"kv_budget": 128}, {"kv_decode_buffer": 0}, {"kv_policy": "snapkv"}, None)
OUTCOMES = ("ok", "aborted", "rejected", "4xx", "5xx", "error")
COLUMNS = [
    "requests",
    "ok",
    "aborted",
    "rejected",
    "4xx",
    "5xx",
    "error",
    "p50_s",
    "p99_s",
    "wall_s",
    "output_tokens",
    "preemptions",
    "eviction_passes",
    "pool_empty",
    "still_serving",
    "passed",
]


@dataclass(frozen=True)
class LoadSettings:
    requests: int
    concurrency: int
    bad_fraction: float = 0.05
    abort_fraction: float = 0.2
    stream_fraction: float = 0.5
    max_tokens: tuple[int, int] = (4, 32)
    #: A streamed request to abort closes its stream after this many chunks (drawn in the range).
    abort_after: tuple[int, int] = (2, 2)
    #: Generate ``max_tokens`` whatever the model writes (the long outputs the pool must hold).
    ignore_eos: bool = False
    prompt_lengths: tuple[tuple[int, float], ...] = PROMPT_LENGTHS
    options: tuple[dict | None, ...] = GOOD_OPTIONS
    server_args: tuple[str, ...] = tuple(SERVER_ARGS)
    seed: int = 0


PRESETS = {
    "quick": LoadSettings(requests=24, concurrency=8, bad_fraction=0.25),
    "full": LoadSettings(requests=1000, concurrency=16),
    "long": LoadSettings(
        requests=40,
        concurrency=12,
        bad_fraction=0.1,
        max_tokens=(256, 1536),
        abort_after=(2, 1000),
        ignore_eos=True,
        prompt_lengths=LONG_PROMPT_LENGTHS,
        options=LONG_OPTIONS,
        server_args=tuple(LONG_SERVER_ARGS),
    ),
}


@dataclass(frozen=True)
class LoadRequest:
    index: int
    kind: str  # "chat", "prompt", "bad"
    prompt: list[int] | str | None
    options: dict | None
    stream: bool
    abort: bool
    max_tokens: int
    expect: str | None = None  # for bad inputs: what the 400 must say
    abort_after: int = 2  # chunks streamed before an aborting client closes the stream
    ignore_eos: bool = False


def plan_requests(settings: LoadSettings, tokenizer) -> list[LoadRequest]:
    """The request mix, fixed by the seed; bad inputs take turns."""
    rng = random.Random(settings.seed)
    lengths = dict(settings.prompt_lengths)
    haystack = {length: haystack_prompts(tokenizer, [length] * 4) for length in {*lengths, BAD_PROMPT_LEN}}
    oversized = haystack_prompts(tokenizer, [MAX_MODEL_LEN + 100])[0]
    planned = []
    for index in range(settings.requests):
        max_tokens = rng.randint(*settings.max_tokens)
        if rng.random() < settings.bad_fraction:
            bad_so_far = sum(request.kind == "bad" for request in planned)
            extra, expect = BAD_INPUTS[bad_so_far % len(BAD_INPUTS)]
            prompt = oversized if extra == "oversized" else haystack[BAD_PROMPT_LEN][0]
            options = None if extra == "oversized" else extra
            planned.append(LoadRequest(index, "bad", prompt, options, False, False, max_tokens, expect))
            continue
        stream = rng.random() < settings.stream_fraction
        abort = stream and rng.random() < settings.abort_fraction / settings.stream_fraction
        options = settings.options[rng.randrange(len(settings.options))]
        kind, prompt = "chat", None
        if rng.random() >= 0.25:
            length = rng.choices(list(lengths), weights=list(lengths.values()))[0]
            kind, prompt = "prompt", rng.choice(haystack[length])
        abort_after = min(rng.randint(*settings.abort_after), max_tokens - 1)
        planned.append(
            LoadRequest(index, kind, prompt, options, stream, abort, max_tokens, None, abort_after, settings.ignore_eos)
        )
    return planned


async def send(client, request: LoadRequest) -> dict:
    """One request through the OpenAI client: its outcome and latency."""
    import openai

    extra_body = {"vllm_xargs": request.options} if request.options else {}
    if request.ignore_eos:
        extra_body["ignore_eos"] = True
    common = dict(
        model=SERVED_NAME,
        max_tokens=request.max_tokens,
        temperature=0,
        stream=request.stream,
        extra_body=extra_body or None,
    )
    start = time.perf_counter()
    outcome, detail, tokens = "ok", None, 0
    try:
        if request.kind == "chat":
            messages = [{"role": "user", "content": f"Name a city in country number {request.index % 50}."}]
            reply = await client.chat.completions.create(messages=messages, **common)
        else:
            reply = await client.completions.create(prompt=request.prompt, **common)
        if request.stream:
            async for _ in reply:  # a chunk a token (a chat stream's first, its role, counts too)
                tokens += 1
                if request.abort and tokens == request.abort_after:
                    await reply.close()
                    outcome = "aborted"
                    break
        else:
            tokens = reply.usage.completion_tokens
    except openai.BadRequestError as error:
        detail = str(error)
        outcome = "rejected" if request.kind == "bad" and request.expect in detail else "4xx"
    except openai.APIStatusError as error:
        outcome, detail = ("5xx" if error.status_code >= 500 else "4xx"), str(error)
    except (openai.APIConnectionError, openai.APITimeoutError) as error:
        outcome, detail = "error", repr(error)
    if request.kind == "bad" and outcome == "ok":
        outcome, detail = "4xx", "a bad input was accepted"
    return {
        "index": request.index,
        "kind": request.kind,
        "outcome": outcome,
        "latency_s": time.perf_counter() - start,
        "tokens": tokens,
        "detail": detail,
    }


async def drive(base: str, planned: list[LoadRequest], concurrency: int) -> list[dict]:
    from openai import AsyncOpenAI
    from tqdm import tqdm

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    progress = tqdm(total=len(planned), desc="requests", unit="req")

    async def one(request: LoadRequest) -> dict:
        async with gate:
            result = await send(client, request)
        progress.update()
        return result

    try:
        return await asyncio.gather(*(one(request) for request in planned))
    finally:
        progress.close()
        await client.close()


def pool_empty(base: str, timeout_s: float = 60) -> bool:
    """vLLM's own gauges: nothing running or waiting, no KV block in use, no compressed request held."""
    wanted = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:kvpolicy_compressed_kv_blocks",
    )
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(base)
        if all(value == 0 for name, value in samples.items() if name.split("{")[0] in wanted):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1)


def still_serving(base: str) -> bool:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    return bool(reply.choices[0].message.content)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """A counter's increase over the load, summed over its label sets."""

    def total(samples: dict[str, float]) -> float:
        return sum(value for key, value in samples.items() if key.split("{")[0] == name)

    return total(after) - total(before)


def run(base: str, settings: LoadSettings, tokenizer) -> tuple[dict, list[dict]]:
    """The load against ``base``: the summary row and every request's result."""
    planned = plan_requests(settings, tokenizer)
    before = scrape(base)
    start = time.perf_counter()
    results = asyncio.run(drive(base, planned, settings.concurrency))
    wall = time.perf_counter() - start
    after = scrape(base)
    counts = {outcome: sum(r["outcome"] == outcome for r in results) for outcome in OUTCOMES}
    latencies = [r["latency_s"] for r in results if r["outcome"] == "ok"]
    summary = {
        "requests": len(results),
        **counts,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "wall_s": wall,
        "output_tokens": sum(r["tokens"] for r in results),
        "preemptions": counter_delta(before, after, "vllm:num_preemptions_total"),
        "eviction_passes": counter_delta(before, after, "vllm:kvpolicy_eviction_passes_total"),
        "pool_empty": pool_empty(base),
        "still_serving": still_serving(base),
    }
    summary["passed"] = (
        counts["5xx"] == counts["4xx"] == counts["error"] == 0 and summary["pool_empty"] and summary["still_serving"]
    )
    summary["failures"] = [r for r in results if r["outcome"] in ("4xx", "5xx", "error")][:20]
    return summary, results


def plot(rows: list[dict], path: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for kind in ("chat", "prompt", "bad"):
        latencies = sorted(r["latency_s"] for r in results if r["kind"] == kind and r["outcome"] != "aborted")
        if latencies:
            left.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))], label=kind)
    left.set(xlabel="latency (s)", ylabel="fraction of requests", title="Latency by request kind", xscale="log")
    left.legend()
    counts = [rows[0][outcome] for outcome in OUTCOMES]
    right.bar(OUTCOMES, counts, color=["tab:green", "tab:blue", "tab:gray", "tab:orange", "tab:red", "black"])
    right.set(title=f"{rows[0]['requests']} requests: outcomes", ylabel="requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_dashboard(prometheus, start: float, end: float, path: Path) -> None:
    """Every dashboard panel, drawn from Prometheus's own answers to the panel's queries over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.prometheus import panel_queries

    panels: dict[str, list] = {}
    for query in panel_queries():
        panels.setdefault(query.panel, []).append(query)
    columns = 3
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(15, 3.2 * rows), squeeze=False)
    for ax, (title, queries) in zip(axes.flat, panels.items()):
        for query in queries:
            for series in prometheus.query_range(query.expr, start, end, step_s=2):
                times = [float(t) - start for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                label = query.legend.replace("{{policy}}", series["metric"].get("policy", "")).strip()
                ax.plot(times, values, label=label or query.ref_id)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("s since the load started", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="24 requests, 8 at a time (the CI version)")
    parser.add_argument("--long", action="store_true", help="40 requests of long outputs, a pool that preempts")
    parser.add_argument("--requests", type=int, help="override the preset's request count")
    parser.add_argument("--concurrency", type=int, help="override the preset's concurrency")
    parser.add_argument("--url", help="a running server's base URL (default: start one on loopback)")
    parser.add_argument("--dashboard", action="store_true", help="scrape with a real Prometheus; plot every panel")
    parser.add_argument(
        "--out", type=Path, help="default: results/load.json (quick: load_quick.json; long: load_long.json)"
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from kvpolicy.offline.model import prepare

    preset = "quick" if args.quick else "long" if args.long else "full"
    settings = PRESETS[preset]
    overrides = {"requests": args.requests, "concurrency": args.concurrency}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v})
    out = args.out or RESULTS_DIR / {"quick": "load_quick.json", "long": "load_long.json"}.get(preset, "load.json")
    model = prepare()
    tokenizer = AutoTokenizer.from_pretrained(str(model))

    def load(base: str) -> tuple[dict, list[dict]]:
        if not args.dashboard:
            return run(base, settings, tokenizer)
        from benchmarks.prometheus import Prometheus

        with Prometheus(target=base.removeprefix("http://")) as prometheus:
            prometheus.wait_for_scrape()
            start = time.time()
            outcome = run(base, settings, tokenizer)
            time.sleep(5)
            plot_dashboard(prometheus, start, time.time(), out.with_name(out.stem + "_dashboard.png"))
        return outcome

    if args.url:
        summary, results = load(args.url)
    else:
        with (
            tempfile.TemporaryDirectory() as tmp,
            vllm_server(model, list(settings.server_args), Path(tmp) / "vllm.log", 2) as base,
        ):
            summary, results = load(base)
    for failure in summary["failures"]:
        print(f"request {failure['index']} ({failure['kind']}): {failure['outcome']}: {failure['detail']}")
    settings_out = {
        **asdict(settings),
        "preset": preset,
        "server": args.url or " ".join(["vllm serve", *settings.server_args]),
    }
    write_results(out, settings_out, [summary], COLUMNS, lambda rows, path: plot(rows, path, results))
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
