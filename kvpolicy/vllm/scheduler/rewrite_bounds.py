"""Scheduler side: the blocks a step may rewrite, known when the step is scheduled.

A relocation, PoD's layout and an offload write a request's own blocks after the step's attention; those
blocks then hold pages, not the tokens their hashes name, and must leave vLLM's prefix cache before any
later request can hit them. vLLM's synchronous scheduler reads each step's report (the blocks each
request kept) before it schedules the next, and the connector evicts exactly those. Its asynchronous
scheduler schedules step N+1 before it reads step N's report; so, there, the connector evicts, when it
schedules step N, every block that step may rewrite. The scheduler knows then what bounds it: each
request's length after the step, its policy and budget, and which of its blocks others share (the
order the worker fills them in, ``write_order``). For a relocation the bound is the worker's own room
check (``relocation_blocks``), for PoD's layout and an offload the blocks they pack into
(``layout_blocks``, ``offload_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpolicy.config import REQUEST_BUDGET_KEY, REQUEST_POLICY_KEY, KVPolicyConfig
from kvpolicy.paging import layout_blocks, offload_blocks, relocation_blocks
from kvpolicy.policies import Mode, Policy


@dataclass
class RewriteBound:
    """What each scheduled step of a request may rewrite, for one engine's configuration and model
    (``num_kv_heads`` per rank, ``num_layers`` on this stage)."""

    config: KVPolicyConfig
    num_kv_heads: int
    num_layers: int
    block_size: int
    #: Requests whose rewritable blocks left the prefix cache for good (until a preemption frees them).
    done: set[str] = field(default_factory=set)
    _policies: dict[str, Policy] = field(default_factory=dict)

    def policy_of(self, request) -> Policy | None:
        """A request's policy (its ``kv_policy``, else the server's); None for ``kv_policy: none``."""
        name = (request.sampling_params.extra_args or {}).get(REQUEST_POLICY_KEY, self.config.policy)
        if name == "none":
            return None
        if name not in self._policies:
            self._policies[name] = self.config.for_policy(name).make_policy()
        return self._policies[name]

    def positions(self, request, num_scheduled: int, order: list[int]) -> list[int]:
        """The positions of ``order`` the step that brings ``request`` to ``num_computed_tokens +
        num_scheduled`` tokens may rewrite, as the worker's mode decides it ([] when none)."""
        policy = self.policy_of(request)
        if policy is None or request.request_id in self.done:
            return []
        end = request.num_computed_tokens + num_scheduled
        complete = end >= request.num_tokens  # the prompt, or after a preemption prompt and output, in the cache
        extra = request.sampling_params.extra_args or {}
        if policy.mode is Mode.RELOCATE:
            budget = self.config.budget_for(request.num_prompt_tokens, extra.get(REQUEST_BUDGET_KEY))
            if budget is None and policy.needs_budget:
                return []  # a short prompt stays on the stock path
            if not complete and not (policy.schedule.per_chunk and end > budget):
                return []
            chooses = request.num_prompt_tokens if complete else end
            entries = policy.layer_token_bound(budget, chooses, self.num_kv_heads)
            entries += self.num_kv_heads * max(end - chooses, 0)  # output recomputed after a preemption
            written = order[: relocation_blocks(entries, self.num_kv_heads, self.block_size)]
        elif policy.mode is Mode.SHARE:
            distant = policy.distant_range(end)
            if not complete or distant[1] - distant[0] < self.block_size:
                return []
            keeps = np.array(policy.layer_groups().keeps_distant_keys())
            written = order[: layout_blocks(keeps, self.block_size, end, distant)]
        elif policy.mode is Mode.SELECT and self.config.offload is not None:
            decoding = num_scheduled == 1 and request.num_prompt_tokens < end
            budget = self.config.sparse_budget(end, self.num_layers, extra.get(REQUEST_BUDGET_KEY))
            if not complete or decoding or budget >= end:
                return []
            full = [source is None for source in policy.source_layers(self.num_layers)]
            staging = -(-budget // self.block_size) - 1
            written = order[: offload_blocks(full, self.num_kv_heads, self.block_size, end, staging)]
        else:
            return []
        if complete:
            self.done.add(request.request_id)
        return written
