"""The worker's page space over the KV caches vLLM itself allocates, in the layout each platform gets.

vLLM puts every layer in one buffer (``allocate_kv_cache``) in the layout
the engine core resolves once: the CPU backend's LBHNC, and on CUDA, where
vLLM's Triton backend declares no layout, LBNHC unless ``VLLM_KV_CACHE_LAYOUT``
says otherwise. kvpolicy sets it for the policies that pool pages over every
layer (``args._choose_page_space_layout``). These build the caches with
vLLM's own functions, on the CPU, for a small model's shape.
"""

import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.worker.utils import allocate_kv_cache

from kvpolicy.config import KVPolicyConfig
from kvpolicy.vllm.internals import EngineArgs
from kvpolicy.vllm.startup import args
from kvpolicy.vllm.worker import cuda_backend
from kvpolicy.vllm.worker.state import PageSpace

NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS = 3, 2, 16, 8, 5
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def resolved_layout(backend) -> str:
    """The layout vLLM's engine core resolves for a worker running ``backend`` (no connector asks for one)."""
    supported = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    return resolve_kv_cache_layout(VllmConfig(), [supported], [SPEC]).name


def vllm_kv_caches(layout: str, device: str = "cpu") -> list[torch.Tensor]:
    """Each layer's cache as vLLM's worker allocates it, in layer order (``GPUModelRunner.initialize_kv_cache``)."""
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = layout
    groups = [KVCacheGroupSpec(LAYERS, SPEC)]
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, NUM_BLOCKS * NUM_LAYERS * SPEC.page_size_bytes
    )
    assert kv_cache_config.num_blocks == NUM_BLOCKS
    resolved = vllm_config.cache_config.get_resolved_kv_cache_layout()
    caches = allocate_kv_cache(kv_cache_config, torch.device(device), resolved, [BLOCK_SIZE])
    return [caches[name] for name in LAYERS]


def test_on_cuda_vllm_would_interleave_heads_and_a_page_space_policy_gets_lbhnc(on_cuda):
    assert resolved_layout(cuda_backend.KVPolicyTritonBackend) == "LBNHC"
    args._prepare_engine_args(EngineArgs(model="m"), KVPolicyConfig(policy="pod"))
    assert resolved_layout(cuda_backend.KVPolicyTritonBackend) == "LBHNC"


def test_the_page_space_addresses_each_layers_block_and_head_of_vllms_lbhnc_caches():
    caches = vllm_kv_caches("LBHNC")
    space = PageSpace.of(caches)
    assert space.pages.shape[1:] == (1, BLOCK_SIZE, 2 * HEAD_SIZE)
    assert space.pages.shape[0] == NUM_LAYERS * NUM_BLOCKS * NUM_KV_HEADS
    for layer, cache in enumerate(caches):
        for block in range(NUM_BLOCKS):
            for head in range(NUM_KV_HEADS):
                page = space.layer_base[layer] + block * NUM_KV_HEADS + head
                value = float(1 + page)
                cache[block, head, 3, 5] = value  # through vLLM's view of the layer
                assert space.pages[page, 0, 3, 5] == value
                assert torch.count_nonzero(space.pages[page]) == 1
                space.pages[page, 0, BLOCK_SIZE - 1, 2 * HEAD_SIZE - 1] = -value  # and back
                assert cache[block, head, BLOCK_SIZE - 1, 2 * HEAD_SIZE - 1] == -value
    assert torch.count_nonzero(space.pages) == 2 * space.pages.shape[0], "each page written once each way"


def test_the_page_space_refuses_vllms_cuda_default_where_a_blocks_heads_interleave():
    with pytest.raises(RuntimeError, match="vLLM's LBHNC layout"):
        PageSpace.of(vllm_kv_caches("LBNHC"))


def test_the_page_space_lies_on_the_caches_device():
    """A tensor takes a storage only on its own device: the page space of a GPU's buffer is on that GPU
    (the meta device stands in for it here)."""
    space = PageSpace.of(vllm_kv_caches("LBHNC", device="meta"))
    assert space.pages.device.type == "meta"
    assert space.pages.shape == (NUM_LAYERS * NUM_BLOCKS * NUM_KV_HEADS, 1, BLOCK_SIZE, 2 * HEAD_SIZE)
    assert space.layer_base == [layer * NUM_BLOCKS * NUM_KV_HEADS for layer in range(NUM_LAYERS)]
