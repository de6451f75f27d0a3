"""Every vLLM internal kvpolicy touches, named in one place (verified on vLLM 0.32.0).

Upgrading vLLM means reading this file and the call sites of what it exports.
Anything imported from ``vllm`` elsewhere in kvpolicy goes through here.
"""

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import CUDAGraphMode, KVTransferConfig, VllmConfig, get_current_vllm_config
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.core import kv_cache_utils
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

#: (module, class) of the OpenAI-compatible request models whose ``vllm_xargs`` (a request's ``kv_*`` options)
#: become ``SamplingParams.extra_args``.
XARGS_REQUEST_MODELS = (
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
)

#: Where the CPU platform's attention backend lives; we subclass its pieces.
CPU_ATTN_MODULE = "vllm.v1.attention.backends.cpu_attn"
#: Where vLLM's Triton attention backend lives (CUDA); the CUDA backend subclasses its pieces. Its cache
#: is [blocks, kv_heads, block_size, 2*head_size] in logical order, any physical strides.
TRITON_ATTN_MODULE = "vllm.v1.attention.backends.triton_attn"
#: The GPU worker (``worker_cls="auto"`` on CUDA).
GPU_WORKER_MODULE = "vllm.v1.worker.gpu_worker"
#: On CUDA vLLM 0.32 picks its V2 model runner unless this is "0" (vllm/config/vllm.py:
#: VllmConfig.use_v2_model_runner); kvpolicy's worker state and step builder read the V1 runner's
#: ``requests``, ``input_batch`` and ``kv_caches``.
MODEL_RUNNER_V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: The KV cache layout vLLM allocates (v1/kv_cache_layout.py: KVCacheLayout), read once by the engine
#: core (v1/attention/backends/utils.py: resolve_kv_cache_layout) before it caches the environment.
#: Every layout puts all layers in one buffer (v1/worker/utils.py: allocate_kv_cache); vLLM's Triton
#: backend declares none, so on CUDA vLLM picks its first default, LBNHC (a block's tokens interleave
#: its heads). kvpolicy's page space needs ``PAGE_SPACE_LAYOUTS``.
KV_CACHE_LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"
#: LBHNC (and its legacy alias HND): layer-major, then block, then head; each layer's cache is one
#: contiguous [blocks, kv_heads, block_size, 2*head_size] slice of the buffer. The CPU backend's only layout.
PAGE_SPACE_LAYOUTS = ("LBHNC", "HND")
#: Cores vLLM's CPU executor keeps away from the workers (vllm/utils/ompmultiprocessing.py).
#: It adds one per rank for *any* KV connector (meant for NIXL transfers).
CPU_RESERVED_CORES_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
#: The worker the CPU platform would pick for ``worker_cls="auto"``.
CPU_WORKER_MODULE = "vllm.v1.worker.cpu_worker"
#: The KV bytes one request of ``max_model_len`` tokens needs, in ``kv_cache_utils``: the startup
#: check ("To serve at least one request with the model's max seq len ...") calls these, through
#: the module, with the config first (v1/core/kv_cache_utils.py: check_enough_kv_cache_memory,
#: get_kv_cache_configs).
KV_MEMORY_NEEDED_FUNCTIONS = ("max_memory_usage_bytes", "_max_memory_usage_bytes_from_groups")


def release_blocks_except(kv_cache_manager, req_id: str, keep: set[int], seen: int) -> None:
    """Free a request's blocks at every block-table position below ``seen`` not in ``keep``.

    What sliding-window attention does with blocks it no longer reads
    (``SingleTypeKVCacheManager._remove_blocks_in_range``, v1/core/ single_type_kv_cache_manager.py): the freed entries
    become the null block, so the list keeps its length and vLLM keeps appending one block per ``block_size`` logical
    tokens. A freed block that is in the prefix cache stays there (it still holds its tokens). A request that already
    finished is skipped. ``seen``: the positions the worker's step had; vLLM's asynchronous scheduler appends the next
    step's blocks before it reads the step's report (``EngineCore.step_with_batch_queue``), and those are in use.
    """
    for manager in kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(req_id)
        if blocks is None:
            continue
        for position in range(min(len(blocks), seen)):
            if position not in keep:
                # One position at a time: the range form stops at the first null block.
                manager._remove_blocks_in_range(req_id, position, position + 1)


def block_sharing(kv_cache_manager, req_id: str) -> tuple[list[int], list[int]]:
    """Block-table positions of a request's blocks that others read (``ref_cnt`` > 1: never to be
    written) and of those in the prefix cache that only it holds (writable once uncached)."""
    shared, cached = [], []
    for manager in kv_cache_manager.coordinator.single_type_managers:
        for position, block in enumerate(manager.req_to_blocks.get(req_id, ())):
            if block.is_null:
                continue
            if block.ref_cnt > 1:
                shared.append(position)
            elif block.block_hash is not None:
                cached.append(position)
    return shared, cached


def stop_caching(kv_cache_manager, req_id: str, positions: set[int]) -> None:
    """Take the request's blocks at ``positions`` out of the prefix cache, and keep vLLM from caching
    any later block of it: they hold relocated pages, not the tokens their hashes name.

    ``BlockPool.evict_blocks`` drops a block's hashes without freeing it; ``num_cached_block`` is how
    many of a request's blocks ``SingleTypeKVCacheManager.cache_blocks`` has cached already.
    """
    for manager in kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(req_id)
        if blocks is None:
            continue
        ids = {blocks[p].block_id for p in positions if p < len(blocks) and not blocks[p].is_null}
        manager.block_pool.evict_blocks(ids)
        manager.num_cached_block[req_id] = NEVER_CACHE


def held_blocks(kv_cache_manager, req_id: str) -> tuple[int, int] | None:
    """``(live blocks, block-table entries)`` of a request (entries count released ones), or None if it holds none."""
    blocks = kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.get(req_id)
    return None if blocks is None else (sum(not b.is_null for b in blocks), len(blocks))


def host_batch_tensors(cam, runner) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seq_lens, block_table)`` of a step's rows on the host, without waiting for the device: the
    runner's host copies (``CommonAttentionMetadata.seq_lens_cpu_upper_bound``, exact without speculative
    decoding, which kvpolicy refuses; the V1 runner's CPU block table of KV-cache group 0, which it
    copies to the device)."""
    num_reqs = cam.num_reqs
    seq_lens = cam.seq_lens_cpu_upper_bound
    seq_lens = cam.seq_lens[:num_reqs].cpu() if seq_lens is None else seq_lens[:num_reqs]
    return seq_lens, runner.input_batch.block_table[0].get_cpu_tensor()[:num_reqs]


def full_decode_graph_rows(vllm_config) -> int:
    """The most rows of a decode batch vLLM may replay in a full CUDA graph: none unless its CUDA-graph mode
    has full graphs (``CompilationConfig.cudagraph_mode``, resolved by the runner from the builders'
    ``get_cudagraph_support``), else its largest capture size, at most ``max_num_seqs``."""
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return 0
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    return min(max_seqs, compilation.max_cudagraph_capture_size or max_seqs)


def prompt_rows_scheduled(scheduler_output, runner) -> bool:
    """Whether a step reads some prompt tokens: a new request, or a running one whose computed tokens
    (``SchedulerOutput.scheduled_cached_reqs``) have not reached its prompt's end yet (resumed after a
    preemption, or a chunk); one the runner does not hold yet counts as a prompt."""
    if scheduler_output.scheduled_new_reqs:
        return True
    cached = scheduler_output.scheduled_cached_reqs
    requests = runner.requests
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
        request = requests.get(req_id)
        if request is None or computed < request.num_prompt_tokens:
            return True
    return False


def decode_rows_scheduled(scheduler_output, runner):
    """(request id, the runner's request, tokens in its cache after the step) of each running request the
    step brings one token to, past its prompt (a decode row)."""
    cached = scheduler_output.scheduled_cached_reqs
    counts, requests = scheduler_output.num_scheduled_tokens, runner.requests
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
        request = requests.get(req_id)
        if counts.get(req_id) == 1 and request is not None and computed >= request.num_prompt_tokens:
            yield req_id, request, computed + 1


def attention_metadata_builders(runner):
    """Every attention metadata builder of a model runner (made by ``initialize_kv_cache``): the V1
    runner's ``attn_groups`` (one list per KV-cache group), each group's ``metadata_builders`` (one per
    micro-batch)."""
    for groups in runner.attn_groups:
        for group in groups:
            yield from group.metadata_builders


def attention_layer(vllm_config, layer_name: str):
    """vLLM's attention layer of that name (``CompilationConfig.static_forward_context``); its ``kv_cache`` is
    the layer's cache once the runner bound it (``bind_kv_cache``)."""
    return vllm_config.compilation_config.static_forward_context[layer_name]


def worker_connectors():
    """This worker's KV connectors (made by ``ensure_kv_transfer_initialized`` in the worker's
    ``initialize_from_config``): the configured one, and each child of vLLM's ``MultiConnector``
    (``MultiConnector.sub_connectors``)."""
    if not has_kv_transfer_group():
        return []
    connector = get_kv_transfer_group()
    return [connector, *getattr(connector, "sub_connectors", ())]


def tensor_parallel_gather():
    """``(rank, size, gather)`` of this worker's tensor-parallel group; ``gather`` stacks every rank's
    CPU tensor along dim 0 over the group's gloo communicator (``GroupCoordinator.cpu_group``), which
    keeps float64 exact."""
    group = get_tp_group()

    def gather(tensor):
        parts = [torch.empty_like(tensor) for _ in range(group.world_size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group.cpu_group)
        return torch.cat(parts)

    return group.rank_in_group, group.world_size, gather


def name_connector(name: str, module_path: str) -> None:
    """Register connector class ``name`` of ``module_path`` in vLLM's factory, once: ``MultiConnector``
    rebuilds each child's stats in the API server from the child's class name
    (``MultiConnector.build_kv_connector_stats``, ``KVConnectorFactory.get_connector_class_by_name``)."""
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module_path, name)


def pipeline_stage() -> tuple[int, int]:
    """``(rank, size)`` of this worker's pipeline-parallel group: rank 0 holds the first layers."""
    group = get_pp_group()
    return group.rank_in_group, group.world_size


def ensure_intermediate_tensors(runner) -> None:
    """Give a later pipeline stage's runner its buffer for the hidden states it receives.

    The V1 runner makes ``intermediate_tensors`` in ``_dummy_run``; vLLM's CPU
    runner runs that only to warm up compilation (``CPUModelRunner.warming_up_model``),
    so with ``--enforce-eager`` a later stage's first step fails on
    ``assert self.intermediate_tensors is not None``
    (``GPUModelRunner.sync_and_gather_intermediate_tensors``), with or without kvpolicy.
    """
    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


#: ``num_cached_block`` past any request's length: ``cache_blocks`` finds nothing left to cache.
NEVER_CACHE = 1 << 62


__all__ = [
    "XARGS_REQUEST_MODELS",
    "CUDAGraphMode",
    "AsyncEngineArgs",
    "AttentionBackendEnum",
    "AttentionCGSupport",
    "attention_layer",
    "attention_metadata_builders",
    "CPU_ATTN_MODULE",
    "CPU_RESERVED_CORES_ENV",
    "CPU_WORKER_MODULE",
    "EngineArgs",
    "GPU_WORKER_MODULE",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "InputProcessor",
    "KVConnectorWorkerMetadata",
    "KVConnectorStats",
    "KVTransferConfig",
    "KV_CACHE_LAYOUT_ENV",
    "KV_MEMORY_NEEDED_FUNCTIONS",
    "CPULoadStoreSpec",
    "CPUOffloadingSpec",
    "CanonicalKVCaches",
    "GPULoadStoreSpec",
    "OffloadingWorker",
    "PrepareStoreOutput",
    "TransferResult",
    "SamplingParams",
    "TRITON_ATTN_MODULE",
    "MODEL_RUNNER_V2_ENV",
    "PAGE_SPACE_LAYOUTS",
    "VLLMValidationError",
    "VllmConfig",
    "current_platform",
    "envs",
    "extract_layer_index",
    "get_current_vllm_config",
    "get_forward_context",
    "get_kv_transfer_group",
    "kv_cache_utils",
    "has_kv_transfer_group",
    "name_connector",
    "ops",
    "pipeline_stage",
    "register_backend",
    "block_sharing",
    "ensure_intermediate_tensors",
    "held_blocks",
    "host_batch_tensors",
    "release_blocks_except",
    "stop_caching",
    "tensor_parallel_gather",
    "worker_connectors",
]
