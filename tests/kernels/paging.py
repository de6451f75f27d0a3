"""Caches in the three layouts the kernels must serve, shuffled page pools, per-dtype tolerances, and the
implementations (Triton, C++) every shared test runs."""

from __future__ import annotations

import torch

import kvpolicy_triton
from kvpolicy_triton import PageGeometry

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _implementations() -> dict:
    """The ops that share the kernels' arguments: Triton everywhere, C++ (csrc/) on CPU caches."""
    if DEVICE == "cuda":
        return {"triton": kvpolicy_triton}
    import kvpolicy_csrc

    return {"triton": kvpolicy_triton, "csrc": kvpolicy_csrc}


#: Implementation name -> module; tests take the name as a parameter (``-k triton`` or ``-k csrc``).
IMPLEMENTATIONS = _implementations()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Kernel and reference compute in float32 from the same inputs; half outputs differ by their last-bit rounding.
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}
# Layout name -> block size tested with it.
LAYOUTS = {"head_major": 16, "k_transposed": 8, "split_kv": 16}


def make_cache(layout: str, blocks: int, kv_heads: int, head_size: int, dtype, seed: int = 0, block_size=None):
    """A random cache and its geometry; ``blocks * kv_heads`` one-head pages of ``block_size`` tokens
    (default ``LAYOUTS[layout]``).

    ``head_major``: [blocks, kv_heads, bs, 2D] (K then V in a row).
    ``k_transposed``: vLLM's CPU vec-ISA page, K element (t, d) at t + d*bs, then V row-major, built by hand.
    ``split_kv``: [blocks, 2, bs, kv_heads, D], a permuted view of an HND allocation (not contiguous).
    """
    generator = torch.Generator().manual_seed(seed)
    bs = block_size or LAYOUTS[layout]
    if layout == "head_major":
        cache = torch.randn(blocks, kv_heads, bs, 2 * head_size, generator=generator)
        cache = cache.to(DEVICE, dtype)
        return cache, PageGeometry.head_major(cache)
    if layout == "k_transposed":
        page = 2 * bs * head_size
        cache = torch.randn(blocks, kv_heads, page, generator=generator).to(DEVICE, dtype)
        geom = PageGeometry(
            block_size=bs,
            head_size=head_size,
            heads_per_block=kv_heads,
            block_stride=kv_heads * page,
            head_stride=page,
            k_offset=0,
            k_token_stride=1,
            k_dim_stride=bs,
            v_offset=bs * head_size,
            v_token_stride=head_size,
            v_dim_stride=1,
        )
        return cache, geom
    if layout == "split_kv":
        hnd = torch.randn(blocks, 2, kv_heads, bs, head_size, generator=generator).to(DEVICE, dtype)
        cache = hnd.permute(0, 1, 3, 2, 4)
        return cache, PageGeometry.split_kv(cache)
    raise ValueError(layout)


def shuffled_pages(count: int, seed: int = 0) -> torch.Tensor:
    """All page ids of a cache, in random order."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))


def index(values, dtype=torch.int32) -> torch.Tensor:
    """An index tensor as the kernels take them: contiguous, int32 or int64."""
    return torch.as_tensor(values, dtype=dtype, device=DEVICE).contiguous()
