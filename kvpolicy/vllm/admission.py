"""Admission sizing: at startup for policies that evict while the prompt is read (keydiff), and each step
for requests that grow after compression (``GrowingRequest``, ``blocks_to_reserve``).

Such a request never holds more than its budget plus one prompt chunk, so a
KV pool smaller than ``--max-model-len`` can still serve it. vLLM refuses
to start unless one request of ``max_model_len`` tokens fits the pool; for
these policies the refusal is judged on the bound instead. Requests are then
admitted by their first chunk, not their whole prompt (no
``scheduler_reserve_full_isl``), since the chunk is what they hold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvpolicy.policies import POLICIES
from kvpolicy.vllm.args import stored_config
from kvpolicy.vllm.internals import KV_MEMORY_NEEDED_FUNCTIONS, kv_cache_utils

#: Pages over budget + chunk a request may hold: a partly filled page at the
#: end of the kept tokens, one at the end of the chunk, and the spare block.
SLACK_BLOCKS = 3


def request_kv_bound(vllm_config) -> int | None:
    """Tokens one request can hold at most, when the policy bounds it below its length; else None."""
    config = stored_config(vllm_config.additional_config)
    if config is None or config.budget is None or not POLICIES[config.policy].schedule.per_chunk:
        return None
    chunk = vllm_config.scheduler_config.max_num_batched_tokens
    return config.budget + chunk + SLACK_BLOCKS * vllm_config.cache_config.block_size


def _needed_for_bound(needed):
    @functools.wraps(needed)
    def wrapper(vllm_config, *args, **kwargs):
        bound = request_kv_bound(vllm_config)
        model_config = vllm_config.model_config
        if bound is None or bound >= model_config.max_model_len:
            return needed(vllm_config, *args, **kwargs)
        max_model_len = model_config.max_model_len
        model_config.max_model_len = bound
        try:
            return needed(vllm_config, *args, **kwargs)
        finally:
            model_config.max_model_len = max_model_len

    return wrapper


def patch_kv_memory_check() -> None:
    for name in KV_MEMORY_NEEDED_FUNCTIONS:
        setattr(kv_cache_utils, name, _needed_for_bound(getattr(kv_cache_utils, name)))


@dataclass(frozen=True)
class GrowingRequest:
    """A relocated request as admission sees it: ``live`` blocks held, ``table`` block-table entries
    (released ones included), ``length`` tokens so far, ``left`` tokens it may still generate."""

    live: int
    table: int
    length: int
    left: int

    def appended(self, tokens: int, block_size: int) -> int:
        """Blocks vLLM appends to it over its next ``tokens`` tokens (one per ``block_size`` logical tokens)."""
        return max(-(-(self.length + min(tokens, self.left)) // block_size) - self.table, 0)


def blocks_to_reserve(requests: list[GrowingRequest], block_size: int) -> int:
    """The most free blocks relocated requests will take at any one time if each runs to its ``left``
    tokens: what they append until then, less what those that finished first gave back.

    Running requests decode one token per step together, so the worst moments are just before each
    finishes. A request that stops early (EOS) only frees its blocks sooner.
    """
    worst = 0
    for tokens in sorted({r.left for r in requests}):
        taken = sum(r.appended(tokens, block_size) for r in requests if r.left >= tokens)
        returned = sum(r.live + r.appended(r.left, block_size) for r in requests if r.left < tokens)
        worst = max(worst, taken - returned)
    return worst
