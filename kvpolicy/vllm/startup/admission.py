"""Admission sizing at start-up, for policies that evict while the prompt is read (keydiff).

Such a request never holds more than its budget plus one prompt chunk, so a
KV pool smaller than ``--max-model-len`` can still serve it. vLLM refuses
to start unless one request of ``max_model_len`` tokens fits the pool; for
these policies the refusal is judged on the bound instead. Requests are then
admitted by their first chunk, not their whole prompt (no
``scheduler_reserve_full_isl``), since the chunk is what they hold.
"""

from __future__ import annotations

from kvpolicy.config import KVPolicyConfig
from kvpolicy.policies import POLICIES
from kvpolicy.vllm.patches import judge_kv_memory_by

#: Pages over budget + chunk a request may hold: a partly filled page at the
#: end of the kept tokens, one at the end of the chunk, and the spare block.
SLACK_BLOCKS = 3


def request_kv_bound(vllm_config) -> int | None:
    """Tokens one request can hold at most, when the policy bounds it below its length; else None."""
    config = KVPolicyConfig.stored_in(vllm_config.additional_config)
    if config is None or config.budget is None or not POLICIES[config.policy].schedule.per_chunk:
        return None
    chunk = vllm_config.scheduler_config.max_num_batched_tokens
    return config.budget + chunk + SLACK_BLOCKS * vllm_config.cache_config.block_size


def patch_kv_memory_check() -> None:
    judge_kv_memory_by(request_kv_bound)
