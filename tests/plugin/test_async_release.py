"""Block releases under vLLM's asynchronous scheduler, on vLLM's own KV cache manager.

That scheduler schedules step N+1 before it reads step N's report
(``EngineCore.step_with_batch_queue``). A prompt of 256 tokens in 32-token
blocks fills 8 blocks at step N; its first decode token at N+1 takes a 9th,
appended before the report "keep positions 0-7" arrives. Applied to the table
as it is then, that report freed the 9th block while the request wrote into
it, and vLLM hands a freed block without a hash to the next allocation (LIFO):
the next request to cross a block boundary wrote over it.
"""

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvpolicy.vllm.scheduler.connector import BlockReleases, KVPolicyConnector

BLOCK_SIZE = 32


def kv_cache_manager(num_blocks: int = 32) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return KVCacheManager(
        config, max_model_len=2048, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE, enable_caching=False
    )


def scheduler_connector(manager: KVCacheManager) -> KVPolicyConnector:
    """The connector's scheduler side, bound to ``manager`` (what ``update_connector_output`` reads)."""
    connector = KVPolicyConnector.__new__(KVPolicyConnector)
    connector._kv_cache_manager, connector._reading, connector._relocated = manager, {}, {}
    return connector


def prompt_read_then_next_step_scheduled(manager: KVCacheManager) -> tuple[Request, int]:
    """Step N reads a 256-token prompt; step N+1 (its first decode token) is scheduled before N's
    report is read. Returns the request and the block N+1 appended."""
    request = Request("prompt", list(range(256)), SamplingParams(max_tokens=24), None)
    manager.allocate_slots(request, 256)
    request.num_computed_tokens = 256
    manager.allocate_slots(request, 1)
    (table,) = manager.get_block_ids("prompt")
    assert len(table) == 9
    return request, table[8]


def next_allocation(manager: KVCacheManager) -> list[int]:
    """The blocks a new request's first chunk gets now."""
    (blocks,) = manager.allocate_slots(
        Request("other", list(range(64)), SamplingParams(max_tokens=1), None), 64
    ).get_block_ids()
    return blocks


def report(seen: int) -> KVConnectorOutput:
    """Step N's release of the relocated prompt: keep its 8 blocks, of the ``seen`` positions the step had."""
    return KVConnectorOutput(kv_connector_worker_meta=BlockReleases({"prompt": set(range(8))}, {"prompt": seen}))


def test_a_release_read_after_the_next_step_was_scheduled_keeps_the_block_that_step_appended():
    manager = kv_cache_manager()
    _, appended = prompt_read_then_next_step_scheduled(manager)
    scheduler_connector(manager).update_connector_output(report(seen=8))
    assert manager.get_block_ids("prompt")[0][8] == appended
    assert appended not in next_allocation(manager)


def test_the_same_release_over_the_whole_table_hands_that_block_to_the_next_request():
    """What the release did before it knew the positions the step had: the block the request
    writes from step N+1 on is the first one vLLM hands out again."""
    manager = kv_cache_manager()
    _, appended = prompt_read_then_next_step_scheduled(manager)
    scheduler_connector(manager).update_connector_output(report(seen=9))
    assert manager.get_block_ids("prompt")[0][8] != appended  # the null block
    assert next_allocation(manager)[0] == appended


def test_tensor_parallel_ranks_keep_what_any_rank_keeps_of_the_positions_every_rank_had():
    first = BlockReleases({"r": {0, 1}}, {"r": 5})
    merged = first.aggregate(BlockReleases({"r": {1, 2}}, {"r": 4}))
    assert merged.keep == {"r": {0, 1, 2}} and merged.seen == {"r": 4}
