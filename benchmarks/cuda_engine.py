"""The whole engine on a GPU: stock vLLM, `none` and every policy on vLLM's CUDA platform, against the CPU engine.

    python benchmarks/cuda_engine.py run --out gpu.json          # on a CUDA machine (1.5 minutes on an H200)
    python benchmarks/cuda_engine.py run --out cpu.json          # the same configs on this CPU machine
    python benchmarks/cuda_engine.py compare gpu.json cpu.json   # writes results/cuda_engine.json and .md
    python benchmarks/cuda_engine.py run --only pod --out pod.json   # some configs only, no server check

Each config is one ``tests/e2e/engine_run.py`` engine on a random-weight Llama built from a fixed seed on both
machines, so the two platforms' counters, tokens and logprobs can be compared. Method and columns:
docs/benchmarks.md#cuda-engine-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: kvpolicy as installed

from benchmarks.common import RESULTS_DIR, markdown_table, provenance, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENGINE_RUN = ROOT / "tests" / "e2e" / "engine_run.py"
MODEL_SHAPE = {"num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "head_size": 64}
BUDGET = "128"
COMMON = ["--block-size", "32", "--pool-mib", "256"]
#: On a GPU: engines run side by side, each asking for this share of its memory, and stock vLLM runs the
#: Triton attention kvpolicy's backend wraps (its FlashAttention build is not needed).
GPU_SHARE = ["--gpu-memory-utilization", "0.06", "--attention-backend", "TRITON_ATTN"]
SCORED = ("snapkv", "adasnap", "pyramid", "adapyramid", "adamix", "streaming", "keydiff", "h2o", "d2o")
#: Configs run on both platforms and compared.
CONFIGS = {
    "stock": ["--stock"],
    "none": ["--policy", "none"],
    "identity": ["--policy", "identity"],
    **{name: ["--policy", name, "--budget", BUDGET] for name in SCORED},
    "omnikv": ["--policy", "omnikv", "--budget", BUDGET, "--filter-layers", "0", "--dense-layers", "0"],
    "adasnap+prefix-caching": ["--policy", "adasnap", "--budget", BUDGET, "--prefix-caching", "--shared-prefix", "512"],
    # 256 recent tokens: the prompts past 288 tokens have a block of distant tokens and are laid out.
    "pod": ["--policy", "pod", "--recent-tokens", "256"],
    # The sparse layers' pages in a host pool (pinned on CUDA), loaded on a side stream after each selection.
    "omnikv+offload": [
        "--policy",
        "omnikv",
        "--budget",
        BUDGET,
        "--filter-layers",
        "0",
        "--dense-layers",
        "0",
        "--offload",
        "1",
    ],
}
#: PoD's grouping of the model: KV head 0 shares layer 0's distant logits with layers 1-2, head 1 layer 1's with 2.
POD_GROUPS = [[[0, 1, 2]], [[0], [1, 2]]]
#: Configs run on CUDA only: what the CUDA path adds.
CUDA_CONFIGS = {"adasnap+cuda-graphs": ["--policy", "adasnap", "--budget", BUDGET, "--cuda-graphs"]}
SERVER_PORT = 8123
ENGINE_TIMEOUT_S = 300
COLUMNS = ["config", "gpu_s", "cpu_s", "same_tokens", "max_logprob_diff", "counters_equal", "blocks_free", "note"]


def tiny_model() -> tuple[str, str]:
    """The model folder and a SHA-256 of its weights' values (the file's header differs between library versions)."""
    import hashlib

    from safetensors.torch import load_file

    from kvpolicy.offline.model import ModelPrepError, prepare_tiny

    try:
        folder = prepare_tiny(**MODEL_SHAPE)
    except ModelPrepError:  # a lent GPU machine: the default model's tokenizer and config come carried
        from benchmarks.gpu.throughput_sweep import unpack_tokenizer

        source = unpack_tokenizer(ROOT / ".cache" / "gpu" / "tokenizer", Path(tempfile.mkdtemp()) / "default")
        folder = prepare_tiny(**MODEL_SHAPE, source=source)
    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(folder / "model.safetensors").items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    return str(folder), digest.hexdigest()


def run_config(name: str, args: list[str], model: str, work: Path) -> dict:
    out = work / f"{name}.json"
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(ENGINE_RUN), "--model", model, *args, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        return {"args": args, "rc": "timeout", "wall_s": ENGINE_TIMEOUT_S, "error_tail": str(exc.stderr or "")[-3000:]}
    record = {"args": args, "rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1)}
    if proc.returncode == 0:
        record["result"] = json.loads(out.read_text())
    else:
        record["error_tail"] = proc.stderr[-3000:]
    return record


def check_server(model: str) -> dict:
    """`vllm serve` with --kv-policy adasnap, asked through the OpenAI client, then its /metrics."""
    import requests
    from openai import OpenAI

    from kvpolicy.offline.sample_text import haystack_text

    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--kv-policy",
        "adasnap",
        "--kv-budget",
        BUDGET,
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
        "--gpu-memory-utilization",
        "0.1",
        "--port",
        str(SERVER_PORT),
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{SERVER_PORT}"
    try:
        for _ in range(180):
            try:
                if requests.get(f"{base}/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            if server.poll() is not None:
                return {"ok": False, "error_tail": server.stdout.read()[-3000:]}
            time.sleep(1)
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        prompt = haystack_text()[:6000]
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.0)
        metrics = requests.get(f"{base}/metrics", timeout=5).text
        counters = {
            line.split()[0]: float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("vllm:kvpolicy_") and not line.startswith("#")
        }
        return {
            "ok": True,
            "prompt_tokens": reply.usage.prompt_tokens,
            "completion_tokens": reply.usage.completion_tokens,
            "text": reply.choices[0].text,
            "kvpolicy_metrics": counters,
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def run(args) -> None:
    import torch

    on_cuda = torch.cuda.is_available()
    model, weights = tiny_model()
    jobs = {name: [*cfg, *COMMON, *(GPU_SHARE if on_cuda else [])] for name, cfg in CONFIGS.items()}
    if on_cuda:
        jobs |= {name: [*args, *COMMON, *GPU_SHARE] for name, args in CUDA_CONFIGS.items()}
    if args.only:
        unknown = set(args.only) - set(jobs)
        if unknown:
            raise SystemExit(f"no config {sorted(unknown)} on this platform; configs: {sorted(jobs)}")
        jobs = {name: cfg for name, cfg in jobs.items() if name in args.only}
    payload = {
        **provenance(sys.argv),
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "model": MODEL_SHAPE,
        "weights_sha256": weights,
        "configs": {},
    }
    with (
        tempfile.TemporaryDirectory(prefix="cuda_engine.") as work,
        ThreadPoolExecutor(args.jobs) as pool,
        tqdm(total=len(jobs), desc="engines") as bar,
    ):
        pod_groups = Path(work) / "pod_groups.json"
        pod_groups.write_text(json.dumps({"blocks": POD_GROUPS}))
        jobs = {name: [*cfg, "--pod-groups", str(pod_groups)] if "pod" in cfg else cfg for name, cfg in jobs.items()}
        futures = {pool.submit(run_config, name, cfg, model, Path(work)): name for name, cfg in jobs.items()}
        for future in as_completed(futures):
            name, record = futures[future], future.result()
            payload["configs"][name] = record
            write_json(Path(args.out), payload)  # what finished survives a run cut short
            tqdm.write(f"{name:24s} rc={record['rc']} {record['wall_s']:6.1f}s {record.get('error_tail', '')[-400:]}")
            bar.update()
    if on_cuda and not args.only:
        payload["server"] = check_server(model)
        write_json(Path(args.out), payload)
        print(json.dumps(payload["server"], indent=1))


def compare_requests(a: list[dict], b: list[dict]) -> tuple[int, float]:
    """Requests whose tokens are the same, and the largest logprob gap over steps up to the first differing token."""
    same, worst = 0, 0.0
    for x, y in zip(a, b, strict=True):
        same += x["token_ids"] == y["token_ids"]
        for tx, ty, lx, ly in zip(x["token_ids"], y["token_ids"], x["logprobs"], y["logprobs"]):
            worst = max([worst, *(abs(lx[t] - ly[t]) for t in lx.keys() & ly.keys())])
            if tx != ty:
                break
    return same, worst


def totals(counters: dict) -> dict:
    """kvpolicy's counters without its snapshot gauges (what is held when the run's last stats were sent)."""
    from kvpolicy.vllm.metrics import GAUGES

    snapshots = {name.removeprefix("vllm:kvpolicy_") for name, _, _ in GAUGES.values()}
    return {key: value for key, value in counters.items() if key not in snapshots}


def compare(args) -> None:
    gpu, cpu = (json.loads(Path(p).read_text()) for p in (args.gpu, args.cpu))
    if gpu["weights_sha256"] != cpu["weights_sha256"]:
        raise SystemExit("the two runs used different weights")
    rows = []
    for name, g in gpu["configs"].items():
        c = cpu["configs"].get(name, {})
        row = {"config": name, "gpu_s": g["wall_s"], "cpu_s": c.get("wall_s")}
        if g["rc"]:
            row["note"] = "failed on CUDA: " + g["error_tail"].strip().splitlines()[-1][:120]
        else:
            result = g["result"]
            row["blocks_free"] = result["kv_cache_usage_end"] == 0.0
            if c.get("rc") == 0:
                same, worst = compare_requests(result["requests"], c["result"]["requests"])
                row |= {
                    "same_tokens": f"{same}/{len(result['requests'])}",
                    "max_logprob_diff": worst,
                    "counters_equal": totals(result["counters"]) == totals(c["result"]["counters"]),
                }
            row.setdefault("note", f"kvpolicy ops: {result['ops']}" if result["ops"] else "stock vLLM")
        rows.append(row)
    stock, none = (gpu["configs"][name].get("result") for name in ("stock", "none"))
    same, worst = compare_requests(stock["requests"], none["requests"])
    none_vs_stock = {
        "bitwise": stock["requests"] == none["requests"],
        "same_tokens": f"{same}/{len(stock['requests'])}",
        "max_logprob_diff": worst,
    }
    table = markdown_table(rows, COLUMNS)
    print(table)
    print(f"\nCUDA: --kv-policy none against stock vLLM: {none_vs_stock}")
    print("CUDA: OpenAI server:", json.dumps(gpu.get("server")))
    summary = {
        "gpu": {k: gpu[k] for k in ("command", "machine", "versions", "device")},
        "cpu": {k: cpu[k] for k in ("command", "machine", "versions")},
        "model": gpu["model"],
        "weights_sha256": gpu["weights_sha256"],
        "none_vs_stock_on_cuda": none_vs_stock,
        "server": gpu.get("server"),
        "rows": rows,
    }
    write_json(RESULTS_DIR / "cuda_engine.json", summary)
    (RESULTS_DIR / "cuda_engine.md").write_text(table + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="every config on this machine's platform")
    run_parser.add_argument("--out", required=True)
    run_parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="engines at once")
    run_parser.add_argument("--only", nargs="+", default=None, help="these configs, without the server check")
    compare_parser = sub.add_parser("compare", help="the CUDA run against the CPU run")
    compare_parser.add_argument("gpu")
    compare_parser.add_argument("cpu")
    args = parser.parse_args()
    run(args) if args.command == "run" else compare(args)


if __name__ == "__main__":
    main()
