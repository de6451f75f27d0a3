"""Shared by the kernels here: the element offsets of K or V rows at slots (the Triton side of
PageGeometry), and whether a kernel's ``tl.dot`` may take the cache's own dtype."""

import os

import torch
import triton
import triton.language as tl


def dot_in_cache_dtype(cache: torch.Tensor) -> bool:
    """bf16/fp16 caches feed ``tl.dot`` in their dtype on a GPU; the interpreter computes half types as
    integers, so under ``TRITON_INTERPRET=1`` (and for float32 caches) the kernels use float32."""
    return cache.dtype in (torch.float16, torch.bfloat16) and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def slot_offsets(slots, dims, block_size, heads_per_block, block_stride, head_stride, offset, token_stride, dim_stride):
    """Flat offsets [n, dims] (int64) of the K or V rows at ``slots`` [n]: PageGeometry.element_index in Triton."""
    slots = slots.to(tl.int64)
    page = slots // block_size
    token = slots % block_size
    base = (page // heads_per_block) * block_stride + (page % heads_per_block) * head_stride
    return (base + offset + token * token_stride)[:, None] + dims.to(tl.int64)[None, :] * dim_stride
