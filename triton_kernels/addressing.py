"""Triton side of PageGeometry, shared by the kernels here: the element offsets of K or V rows at slots."""

import triton
import triton.language as tl


@triton.jit
def slot_offsets(slots, dims, block_size, heads_per_block, block_stride, head_stride, offset, token_stride, dim_stride):
    """Flat offsets [n, dims] (int64) of the K or V rows at ``slots`` [n]: PageGeometry.element_index in Triton."""
    slots = slots.to(tl.int64)
    page = slots // block_size
    token = slots % block_size
    base = (page // heads_per_block) * block_stride + (page % heads_per_block) * head_stride
    return (base + offset + token * token_stride)[:, None] + dims.to(tl.int64)[None, :] * dim_stride
