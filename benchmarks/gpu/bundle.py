#!/usr/bin/env python3
"""vLLM 0.32.0 for CUDA, trimmed and split in two parts, for a lent GPU machine without network.

Not the way to install kvpolicy (``pip install "kvpolicy[cuda]"`` is). The lent machine has torch 2.11 (cu130),
triton and transformers but no vLLM and no network, and receives at most 64 MiB per call, so vLLM travels as two
parts: ``build`` (networked) downloads the pinned wheels of ``bundle_requirements.txt``, keeps of vLLM's wheel what
dense Llama/Qwen-shaped models need on Hopper and writes the parts, ``SHA256SUMS`` and a manifest; ``unpack`` (the
target, standard library only) checks and extracts each part that arrived; ``lock`` rewrites
``bundle_requirements.txt`` from vLLM's metadata, the target's package list and the exclusions below.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "bundle_requirements.txt"
TARGET_PACKAGES = HERE / "target_packages.txt"
DEFAULT_PARTS = HERE / "parts"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpolicy" / "gpu-bundle" / "wheels"

VLLM = "vllm==0.32.0"
PYTHON = "3.12"
#: pip takes an explicit --platform literally (no older glibc tags), so each accepted tag is named.
#: 2.31 is the newest glibc a pinned wheel needs (llguidance 1.7); ``unpack`` checks the target's.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(31, 16, -1)] + ["manylinux2014_x86_64"]
MIB = 1 << 20
#: What one call to the lent machine carries: the tracked working tree plus the carried paths.
CALL_LIMIT = 64 * MIB
#: One part; the rest of a call (8 MiB) is left to the working tree (4.8 MB tracked) and SHA256SUMS.
PART_BOUND = 56 * MIB
MAX_PARTS = 2
SUMS = "SHA256SUMS"
MANIFEST = "manifest.json"
PART_GLOB = "vllm-gpu-part*.tar.xz"
#: Inside the target folder: one file per unpacked part, holding its sha256.
DONE_DIR = ".kvpolicy-gpu-bundle"
XZ_PRESET = 6
#: Files at least this big travel as their own unit, so the split can place them apart.
ALONE = 8 * MIB
#: Every member's mtime (1980-01-01), so a rebuild writes the same bytes.
MTIME = 315532800
#: Room left in each part for the stream that ends its tar archive.
END_RESERVE = 4096

#: vLLM's compiled members that dense Llama/Qwen-shaped models on Hopper need, with why.
VLLM_KEEP = {
    "vllm/_C_stable_libtorch.abi3.so": "vLLM's CUDA ops (KV-cache writes, norms, activations, rotary "
    "embedding); platforms/cuda.py imports it at module level",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": "FlashAttention 3: on CUDA, v1/attention/backends/fa_utils.py "
    "imports vllm.vllm_flash_attn for every model (model_executor/layers/attention imports "
    "mm_encoder_attention, which imports fa_utils), and vllm_flash_attn raises ImportError unless FA2 or "
    "FA3 loads; FA3 is the one Hopper runs",
    "vllm/cumem_allocator.abi3.so": "the allocator behind sleep mode (device_allocator/cumem.py); 30 KB",
    "vllm/spinloop.abi3.so": "the spin loop of shm_broadcast under VLLM_USE_SPINLOOP_EXT; 20 KB",
    "vllm/fs_io_C.abi3.so": "the file tier of KV offloading (v1/kv_offload/tiering/fs); 30 KB",
}

#: What is dropped from vLLM's wheel (a path, or a folder ending in "/"), with why no such model loads it.
VLLM_DROP = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 (308 MB unpacked) serves pre-Hopper GPUs; "
    "on Hopper fa_utils.get_flash_attn_version picks FA3",
    "vllm/_moe_C_stable_libtorch.abi3.so": "mixture-of-experts ops: platforms/cuda.py imports it under "
    "suppress(ImportError) and only fused-MoE layers call them",
    "vllm/vllm-rs": "the Rust frontend binary, run only under VLLM_USE_RUST_FRONTEND=1 or "
    "VLLM_USE_RUST_BENCH=1 (envs.py)",
    "vllm/_flashmla_C.abi3.so": "FlashMLA, multi-head latent attention (DeepSeek-style models): imported "
    "under try in v1/attention/ops/flashmla.py",
    "vllm/_flashmla_extension_C.abi3.so": "FlashMLA's FP8 extension, as _flashmla_C",
    "vllm/_deepselect_C.abi3.so": "the top-k of DeepSeek's sparse-attention indexer: imported lazily by "
    "model_executor/layers/indexer_topk.py",
    "vllm/_flashkda_C.abi3.so": "KDA linear attention of Kimi and GLM models: imported inside those models",
    "vllm/_qutlass_C.abi3.so": "QuTLASS FP4 quantization ops: imported under suppress(ImportError)",
    "vllm/third_party/deep_gemm/": "DeepGEMM's FP8 GEMMs (a 37 MB library, 27 MB of CUTLASS headers); its "
    "Python goes too, since utils/import_utils.has_deep_gemm() looks only for the module and would "
    "turn FP8 paths and their warm-up on",
    "vllm/third_party/fmha_sm100/": "Blackwell (SM100) sparse attention of MiniMax M3, with 28 MB of CUTLASS "
    "headers; imported only inside that model",
}

#: vLLM requirements left out of the bundle: CUDA-only packages (or ones the target has) that dense
#: Llama/Qwen-shaped models on the Triton (kvpolicy) or FlashAttention 3 (plain vLLM) path do not load.
EXCLUDED = {
    "torch": "the target has torch 2.11.0+cu130; vLLM's kernels call only torch's stable C interface, "
    "and a second torch would not fit a part",
    "torchvision": "the target has 0.26.0, built for its torch; multimodal processors only",
    "torchaudio": "the target has 2.11.0; audio models only",
    "torchcodec": "video decoding for multimodal inputs, built against one torch release",
    "pynvvideocodec": "NVIDIA hardware video decoding for multimodal inputs (a 43 MB wheel)",
    "flashinfer-python": "FlashInfer's attention, sampling and communication kernels (34 MB, compiled "
    "at run time): used only when its backend is chosen or its sampler enabled",
    "nvidia-cudnn-frontend": "cuDNN's graph API, for FlashInfer's cuDNN prefill",
    "tilelang": "TileLang kernels (a 51 MB wheel) of DeepSeek-style models (mHC, sparse attention)",
    "nvidia-cutlass-dsl": "the CuTe DSL (92 MB of libraries) behind FlashAttention 4 (Blackwell) and the "
    "CuTe-DSL kernels of DeepSeek's indexer and gated delta nets",
    "quack-kernels": "CuTe-DSL kernels; need nvidia-cutlass-dsl",
    "tokenspeed-mla": "latent-attention (MLA) kernels; pull nvidia-cutlass-dsl and a 95 MB Triton fork",
    "humming-kernels": "GEMMs for the 'humming' quantization method; its cu13 extra pulls CUDA's compiler "
    "(nvidia-cuda-nvcc, 47 MB)",
    "fastsafetensors": "another weight loader (--load-format fastsafetensors)",
    "instanttensor": "another weight loader (--load-format instanttensor)",
}


class BundleError(Exception):
    """A bundle that cannot be built or unpacked as asked: the message says which file and why."""


def canonical(name: str) -> str:
    """A package name as the index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


# ---------------------------------------------------------------- what travels


@dataclass(frozen=True)
class Member:
    """One file of the bundle: where it lands in the site folder and its entry in the wheel."""

    path: str
    entry: str
    size: int
    mode: int


@dataclass(frozen=True)
class Unit:
    """Files of one wheel that are compressed together and land in the same part."""

    name: str
    wheel: Path
    members: tuple[Member, ...]

    @property
    def size(self) -> int:
        return sum(m.size for m in self.members)


@dataclass(frozen=True)
class Dropped:
    """Files of vLLM's wheel left out under one rule."""

    rule: str
    files: int
    size: int
    reason: str


def site_path(entry: str) -> str | None:
    """Where a wheel entry lands in a site-packages folder; None for scripts, headers and data files."""
    head, _, rest = entry.partition("/")
    if head.endswith(".data"):
        kind, _, inner = rest.partition("/")
        return inner if kind in ("purelib", "platlib") and inner else None
    return entry


def is_compiled(entry: str, mode: int) -> bool:
    """A shared library, or an executable with no file suffix (a binary rather than a script)."""
    base = entry.rsplit("/", 1)[-1]
    return bool(re.search(r"\.so(\.\d+)*$", base)) or (bool(mode & 0o111) and "." not in base)


def wheel_members(wheel: Path) -> tuple[list[Member], list[str]]:
    """The files a wheel installs into site-packages, and the entries it would install elsewhere."""
    members, elsewhere = [], []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            path = site_path(info.filename)
            if path is None:
                elsewhere.append(info.filename)
                continue
            mode = (info.external_attr >> 16) & 0o777 or 0o644
            members.append(Member(path, info.filename, info.file_size, mode | 0o600))
    return members, elsewhere


def drop_rule(path: str) -> str | None:
    return next((rule for rule in VLLM_DROP if path == rule or (rule.endswith("/") and path.startswith(rule))), None)


def trim_vllm(members: list[Member]) -> tuple[list[Member], list[Dropped]]:
    """vLLM's files that dense models on Hopper need; every compiled file must be kept or dropped by name."""
    kept, dropped = [], {}
    for m in members:
        rule = drop_rule(m.path)
        if rule is not None:
            files, size = dropped.get(rule, (0, 0))
            dropped[rule] = (files + 1, size + m.size)
        elif m.path in VLLM_KEEP or not is_compiled(m.path, m.mode):
            kept.append(m)
        else:
            raise BundleError(f"{m.path}: a compiled file neither kept nor dropped; add it to VLLM_KEEP or VLLM_DROP")
    missing = sorted(set(VLLM_KEEP) - {m.path for m in kept})
    if missing:
        raise BundleError(f"vLLM's wheel lacks what the bundle must keep: {', '.join(missing)}")
    return kept, [Dropped(rule, files, size, VLLM_DROP[rule]) for rule, (files, size) in dropped.items()]


def split_units(name: str, wheel: Path, members: list[Member]) -> list[Unit]:
    """One unit per big file (named after it), one for the rest of the wheel."""
    alone = [m for m in members if m.size >= ALONE]
    rest = tuple(m for m in members if m.size < ALONE)
    units = [Unit(f"{name}: {m.path.rsplit('/', 1)[-1]}", wheel, (m,)) for m in alone]
    return units + ([Unit(name, wheel, rest)] if rest else [])


# ---------------------------------------------------------------- parts


@dataclass(frozen=True)
class Packed:
    """A unit as tar members compressed into one xz stream; parts concatenate such streams."""

    unit: Unit
    blob: bytes
    tar_size: int


def tar_header(member: Member) -> bytes:
    info = tarfile.TarInfo(member.path)
    info.size, info.mode, info.mtime = member.size, member.mode, MTIME
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def pack_unit(unit: Unit) -> Packed:
    """The unit's members in tar layout (no end-of-archive blocks), as one xz stream."""
    compressor = lzma.LZMACompressor(preset=XZ_PRESET)
    chunks, tar_size = [], 0
    with zipfile.ZipFile(unit.wheel) as z:
        for member in unit.members:
            data = z.read(member.entry)
            for piece in (tar_header(member), data, b"\0" * (-len(data) % tarfile.BLOCKSIZE)):
                chunks.append(compressor.compress(piece))
                tar_size += len(piece)
    chunks.append(compressor.flush())
    return Packed(unit, b"".join(chunks), tar_size)


def tar_end(tar_size: int) -> bytes:
    """The xz stream that ends a tar archive of ``tar_size`` bytes: two zero blocks, padded to a record."""
    zeros = 2 * tarfile.BLOCKSIZE
    zeros += -(tar_size + zeros) % tarfile.RECORDSIZE
    return lzma.compress(b"\0" * zeros, preset=XZ_PRESET)


def plan_parts(sizes: dict[str, int], capacity: int, max_parts: int = MAX_PARTS) -> list[list[str]]:
    """Units placed into the fewest parts of ``capacity`` bytes (at most ``max_parts``), biggest first,
    each into the part with the most room, so the parts come out about even and each keeps some slack."""
    too_big = [name for name, size in sizes.items() if size > capacity]
    if too_big:
        raise BundleError(
            f"{too_big[0]} alone is {sizes[too_big[0]]:,} bytes compressed, more than a part's {capacity:,}"
        )
    for count in range(1, max_parts + 1):
        parts: list[list[str]] = [[] for _ in range(count)]
        room = [capacity] * count
        for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
            slot = max(range(count), key=lambda i: room[i])
            if sizes[name] > room[slot]:
                break
            parts[slot].append(name)
            room[slot] -= sizes[name]
        else:
            return [part for part in parts if part]
    raise BundleError(
        f"the bundle ({sum(sizes.values()):,} bytes compressed) does not fit {max_parts} parts of {capacity:,} bytes"
    )


def part_name(index: int) -> str:
    return f"vllm-gpu-part{index}.tar.xz"


def write_parts(packed: list[Packed], out: Path, bound: int = PART_BOUND) -> list[dict]:
    """The parts (each a .tar.xz of at most ``bound`` bytes) and SHA256SUMS, in ``out``."""
    by_name = {p.unit.name: p for p in packed}
    plan = plan_parts({name: len(p.blob) for name, p in by_name.items()}, bound - END_RESERVE)
    for old in [*out.glob(PART_GLOB), out / SUMS]:
        old.unlink(missing_ok=True)
    parts = []
    for index, names in enumerate(plan, 1):
        path = out / part_name(index)
        with open(path, "wb") as f:
            f.writelines(by_name[name].blob for name in names)
            f.write(tar_end(sum(by_name[name].tar_size for name in names)))
        parts.append({"file": path.name, "bytes": path.stat().st_size, "sha256": sha256(path), "units": names})
    (out / SUMS).write_text("".join(f"{p['sha256']}  {p['file']}\n" for p in parts))
    return parts


# ---------------------------------------------------------------- build


def read_pins(path: Path) -> list[str]:
    """The ``name==version`` lines of a requirements file, comments dropped."""
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", line):
                raise BundleError(f"{path.name}: {line!r} is not a name==version pin")
            pins.append(line)
    return pins


def platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    return args + [arg for tag in PLATFORMS for arg in ("--platform", tag)]


def cached_wheel(pin: str, cache: Path) -> Path | None:
    name, version = pin.split("==")
    return next(
        (
            w
            for w in sorted(cache.glob("*.whl"))
            if canonical(w.name.split("-")[0]) == canonical(name) and w.name.split("-")[1] == version
        ),
        None,
    )


def fetch_wheels(pins: list[str], cache: Path) -> dict[str, Path]:
    """Each pin's wheel for the target, downloaded into ``cache`` unless already there."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [pin for pin in pins if cached_wheel(pin, cache) is None]
    print(
        f"      wheels: {len(pins)} pinned, {len(pins) - len(missing)} in {cache}, downloading {len(missing)}",
        flush=True,
    )
    if missing:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", *platform_args(), "-d", str(cache), *missing],
            check=True,
        )
    wheels = {pin: cached_wheel(pin, cache) for pin in pins}
    absent = [pin for pin, wheel in wheels.items() if wheel is None]
    if absent:
        raise BundleError(f"pip downloaded no wheel for {', '.join(absent)}")
    return wheels


def glibc_needed(wheel: Path) -> tuple[int, int]:
    """The oldest glibc among a wheel's platform tags (0, 0 for a pure-Python wheel)."""
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    found = [(int(a), int(b)) for a, b in re.findall(r"manylinux_(\d+)_(\d+)", wheel.name)]
    found += [version for tag, version in legacy.items() if f"{tag}_" in wheel.name]
    return min(found, default=(0, 0))


def compress_all(units: list[Unit]) -> list[Packed]:
    """Every unit compressed, in parallel (lzma releases the GIL): a progress bar where tqdm is installed, a line per unit otherwise."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = [pool.submit(pack_unit, unit) for unit in sorted(units, key=lambda u: -u.size)]
        done = concurrent.futures.as_completed(futures)
        if tqdm is not None:
            return [future.result() for future in tqdm(done, total=len(futures), unit="unit", desc="      xz")]
        packed = []
        for count, future in enumerate(done, 1):
            packed.append(future.result())
            unit, blob = packed[-1].unit, packed[-1].blob
            print(f"      xz {count}/{len(futures)}: {unit.name}, {mb(unit.size)} -> {mb(len(blob))}", flush=True)
        return packed


def build(out: Path, cache: Path) -> None:
    started = time.monotonic()
    pins = read_pins(REQUIREMENTS)
    if VLLM not in pins:
        raise BundleError(f"{REQUIREMENTS.name} does not pin {VLLM}")
    print(f"[1/4] wheels for CPython {PYTHON} on x86-64 Linux", flush=True)
    wheels = fetch_wheels(pins, cache)

    units, packages, elsewhere = [], [], []
    vllm_dropped: list[Dropped] = []
    for pin, wheel in wheels.items():
        members, skipped = wheel_members(wheel)
        elsewhere += [f"{wheel.name}: {entry}" for entry in skipped]
        if pin == VLLM:
            before = sum(m.size for m in members)
            members, vllm_dropped = trim_vllm(members)
            kept = sum(m.size for m in members)
            print(
                f"[2/4] vLLM trimmed: {len(members)} files kept ({mb(kept)}), {mb(before - kept)} dropped", flush=True
            )
        units += split_units(pin, wheel, members)
        packages.append(
            {"pin": pin, "wheel": wheel.name, "files": len(members), "unpacked_bytes": sum(m.size for m in members)}
        )

    print(
        f"[3/4] compressing {len(units)} units ({mb(sum(u.size for u in units))} unpacked), xz -{XZ_PRESET}", flush=True
    )
    packed = compress_all(units)
    out.mkdir(parents=True, exist_ok=True)
    parts = write_parts(packed, out)
    print(f"[4/4] {len(parts)} parts in {out} (each at most {PART_BOUND:,} bytes):", flush=True)
    for part in parts:
        print(f"      {part['file']}: {part['bytes']:,} bytes, {len(part['units'])} units")

    part_of = {name: part["file"] for part in parts for name in part["units"]}
    glibc = max(glibc_needed(wheel) for wheel in wheels.values())
    manifest = {
        "vllm": VLLM,
        "python": PYTHON,
        "glibc_min": f"{glibc[0]}.{glibc[1]}",
        "call_limit_bytes": CALL_LIMIT,
        "part_bound_bytes": PART_BOUND,
        "parts": [{k: part[k] for k in ("file", "bytes", "sha256")} for part in parts],
        "units": [
            {
                "unit": p.unit.name,
                "files": len(p.unit.members),
                "unpacked_bytes": p.unit.size,
                "xz_bytes": len(p.blob),
                "part": part_of[p.unit.name],
            }
            for p in sorted(packed, key=lambda p: p.unit.name)
        ],
        "packages": packages,
        "vllm_kept_compiled": [
            {
                "path": path,
                "unpacked_bytes": next(m.size for u in units for m in u.members if m.path == path),
                "reason": reason,
            }
            for path, reason in VLLM_KEEP.items()
        ],
        "vllm_dropped": [
            {"rule": d.rule, "files": d.files, "unpacked_bytes": d.size, "reason": d.reason} for d in vllm_dropped
        ],
        "not_installed_entries": elsewhere,
        "excluded_packages": EXCLUDED,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"      {MANIFEST} and {SUMS} written; built in {manifest['build_seconds']} s")


# ---------------------------------------------------------------- unpack (standard library only)


def read_sums(parts_dir: Path) -> dict[str, str]:
    path = parts_dir / SUMS
    if not path.exists():
        raise BundleError(f"{path} is missing: copy {SUMS} with every part")
    sums = {}
    for line in path.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name:
            raise BundleError(f"{path}: cannot read the line {line!r}")
        sums[name] = digest
    return sums


def check_interpreter(parts_dir: Path) -> None:
    """Warn when this Python or glibc is not what the bundle's compiled wheels were chosen for."""
    manifest = parts_dir / MANIFEST
    if not manifest.exists():
        return
    wanted = json.loads(manifest.read_text())
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if here != wanted["python"]:
        print(f"warning: the bundle's compiled wheels are for CPython {wanted['python']}; this is {here}")
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    if libc and libc.startswith("glibc "):
        have = tuple(int(x) for x in libc.split()[1].split(".")[:2])
        need = tuple(int(x) for x in wanted["glibc_min"].split("."))
        if have < need:
            print(f"warning: some wheels need glibc {wanted['glibc_min']}; this machine has {libc}")


def extract(part: Path, target: Path) -> None:
    with tarfile.open(part, "r:xz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(target, filter="data")
        else:
            tar.extractall(target)


def unpack(parts_dir: Path, target: Path, complete: bool = False) -> int:
    """Extract each part present and not yet in ``target``; 0 unless ``complete`` and a part is still missing."""
    sums = read_sums(parts_dir)
    check_interpreter(parts_dir)
    done = target / DONE_DIR
    done.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, digest in sums.items():
        marker = done / name
        if marker.exists() and marker.read_text().strip() == digest:
            print(f"{name}: already unpacked in {target}")
            continue
        part = parts_dir / name
        if not part.exists():
            missing.append(name)
            print(f"{name}: not in {parts_dir} and not yet unpacked")
            continue
        actual = sha256(part)
        if actual != digest:
            raise BundleError(f"{part} is corrupt: its sha256 is {actual}, {SUMS} says {digest}; copy it again")
        started = time.monotonic()
        extract(part, target)
        marker.write_text(digest + "\n")
        print(
            f"{name}: checked and unpacked into {target} ({part.stat().st_size:,} bytes, {time.monotonic() - started:.1f} s)"
        )
    if missing:
        print(f"incomplete: {', '.join(missing)} still to come; run unpack again once it is in {parts_dir}")
    else:
        print(f"complete: all {len(sums)} parts unpacked")
    print(f"export PYTHONPATH={target}${{PYTHONPATH:+:$PYTHONPATH}}")
    return 3 if missing and complete else 0


# ---------------------------------------------------------------- lock (maintainers; needs pip and network)


def target_packages() -> dict[str, str | None]:
    """The target image's packages: canonical name to version (None where not read)."""
    found = {}
    for line in TARGET_PACKAGES.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[canonical(name)] = version or None
    return found


def lock() -> None:
    """Rewrite bundle_requirements.txt: vLLM's dependency closure, minus the target's packages and EXCLUDED."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement

    env = {
        "python_version": PYTHON,
        "python_full_version": f"{PYTHON}.3",
        "platform_machine": "x86_64",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }

    def applies(req, extras) -> bool:
        return req.marker is None or any(req.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras))

    wheel = fetch_wheels([VLLM], CACHE)[VLLM]
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    vllm_requires = [
        Requirement(line.split(":", 1)[1].strip())
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    present = target_packages()
    stop = set(present) | set(EXCLUDED)
    direct = [r for r in vllm_requires if applies(r, ()) and canonical(r.name) not in stop]

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        (Path(tmp) / "req.txt").write_text("".join(f"{r}\n" for r in direct))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--report",
                str(report),
                "--target",
                str(Path(tmp) / "t"),
                *platform_args(),
                "-r",
                str(Path(tmp) / "req.txt"),
            ],
            check=True,
        )
        resolved = {
            canonical(item["metadata"]["name"]): item["metadata"] for item in json.loads(report.read_text())["install"]
        }

    via: dict[str, set[str]] = {}
    on_target: list[tuple[str, str, str]] = [
        (canonical(r.name), str(r.specifier), "vllm")
        for r in vllm_requires
        if applies(r, ()) and canonical(r.name) in present and str(r.specifier)
    ]
    todo = [(canonical(r.name), tuple(sorted(r.extras)), "vllm") for r in direct]
    seen = set()
    while todo:
        name, extras, parent = todo.pop()
        via.setdefault(name, set()).add(parent)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for req in map(Requirement, resolved[name].get("requires_dist") or []):
            if not applies(req, extras):
                continue
            child = canonical(req.name)
            if child == name:
                todo.append((name, tuple(sorted(set(extras) | req.extras)), parent))
            elif child in present:
                if str(req.specifier):
                    on_target.append((child, str(req.specifier), name))
            elif child not in EXCLUDED:
                todo.append((child, tuple(sorted(req.extras)), name))

    lines = [
        "# vLLM 0.32.0 for CUDA and the packages of its dependency closure that the lent GPU machine's image",
        "# (target_packages.txt) lacks, for CPython 3.12 on x86-64 Linux. Written by",
        "# `python3 benchmarks/gpu/bundle.py lock`; `build` downloads exactly these wheels.",
        VLLM,
    ]
    width = max(len(f"{n}=={resolved[n]['version']}") for n in via)
    lines += [
        f"{f'{n}==' + resolved[n]['version']:<{width}}  # via {', '.join(sorted(via[n] - {n}))}" for n in sorted(via)
    ]
    lines += [
        "",
        "# Left out: vLLM requires them, but dense Llama/Qwen-shaped models on the Triton or FlashAttention 3",
        "# path do not load them (with what each pulls in, they would not fit two parts):",
    ]
    lines += [f"#   {name}: {reason}" for name, reason in EXCLUDED.items()]
    lines += [
        "",
        "# Asked of packages the target already has, by the bundle and vLLM ('!': the target's version, where",
        "# read, does not satisfy it; the bundle relies on the target's version all the same):",
    ]
    asked: dict[str, tuple[set[str], set[str]]] = {}
    for name, spec, by in on_target:
        asked.setdefault(name, (set(), set()))[0].update(spec.split(","))
        asked[name][1].add(by)
    for name, (specs, by) in sorted(asked.items()):
        spec, version = ",".join(sorted(specs)), present[name]
        fits = version is None or Requirement(f"{name}{spec}").specifier.contains(
            version.split("+")[0], prereleases=True
        )
        seen_version = "" if version is None else f"; target {version}" + ("" if fits else " !")
        lines.append(f"#   {name}{spec} (by {', '.join(sorted(by))}{seen_version})")
    REQUIREMENTS.write_text("\n".join(lines) + "\n")
    print(f"{REQUIREMENTS}: {VLLM} and {len(via)} packages")


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="download, trim and split into parts (needs pip and network)")
    build_cmd.add_argument(
        "--out", type=Path, default=DEFAULT_PARTS, help="folder for the parts (default: %(default)s)"
    )
    build_cmd.add_argument(
        "--cache", type=Path, default=CACHE, help="folder for downloaded wheels (default: %(default)s)"
    )
    unpack_cmd = commands.add_parser("unpack", help="check and extract the parts present (standard library only)")
    unpack_cmd.add_argument("parts_dir", type=Path, nargs="?", default=DEFAULT_PARTS)
    unpack_cmd.add_argument("--target", type=Path, required=True, help="the folder to put on PYTHONPATH")
    unpack_cmd.add_argument("--complete", action="store_true", help="exit with 3 while a part is still missing")
    commands.add_parser("lock", help=f"rewrite {REQUIREMENTS.name} (needs pip, packaging and network)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            build(args.out, args.cache)
        elif args.command == "unpack":
            return unpack(args.parts_dir, args.target, args.complete)
        else:
            lock()
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
