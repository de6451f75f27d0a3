"""A request in one step, as both processes know it when the step is scheduled: what every mode's rules read
(``ModeState.written_blocks``, ``decode_passes``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy.config import REQUEST_BUDGET_KEY, REQUEST_DECODE_BUFFER_KEY, KVPolicyConfig
from kvpolicy.policies import Policy


@dataclass(frozen=True)
class RequestStep:
    """One request in one step, as both processes know it when the step is scheduled: the scheduler from
    its request (``num_computed_tokens`` plus the tokens scheduled), a worker from the step's batch row."""

    policy: Policy  # the request's own
    config: KVPolicyConfig  # the server's
    prompt_len: int
    num_tokens: int  # the tokens known: the prompt, or after a preemption the prompt and its output
    end: int  # tokens in the cache after the step
    query_len: int  # tokens the step brings
    budget_arg: int | None  # the request's ``kv_budget``
    num_kv_heads: int
    num_layers: int
    block_size: int
    decode_buffer_arg: int | None = None  # the request's ``kv_decode_buffer``

    @classmethod
    def of(cls, policy: Policy, config: KVPolicyConfig, request, end: int, query_len: int, num_kv_heads: int,
           num_layers: int, block_size: int) -> RequestStep:  # fmt: skip
        """From a request as either process holds it: vLLM's scheduler ``Request`` and the runner's request
        state both carry ``num_prompt_tokens``, ``num_tokens`` and the ``sampling_params`` with its options."""
        extra = request.sampling_params.extra_args or {}
        return cls(
            policy, config, request.num_prompt_tokens, request.num_tokens, end, query_len,
            extra.get(REQUEST_BUDGET_KEY), num_kv_heads, num_layers, block_size, extra.get(REQUEST_DECODE_BUFFER_KEY),
        )  # fmt: skip

    @property
    def complete(self) -> bool:
        """Every known token is in the cache after the step (the prompt is read, or recomputed)."""
        return self.end >= self.num_tokens
