"""Scheduler side: the blocks a step may rewrite, evicted from vLLM's prefix cache when the step is scheduled.

Under vLLM's asynchronous scheduler step N+1 is scheduled before step N's report arrives, so the blocks a
relocation, PoD's layout or an offload may rewrite must leave the prefix cache in advance; how many a step
writes is its mode's rule (``ModeState.written_blocks``), the same code the worker's mode decides with
(docs/architecture.md has the whole story). This module keeps no rule of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpolicy.config import REQUEST_POLICY_KEY, KVPolicyConfig
from kvpolicy.policies import Policy
from kvpolicy.vllm.worker.modes import MODES, RequestStep


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
        if policy is None or request.request_id in self.done or policy.mode not in MODES:
            return []
        mode = MODES[policy.mode].state
        end = request.num_computed_tokens + num_scheduled
        step = RequestStep.of(
            policy, self.config, request, end, num_scheduled, self.num_kv_heads, self.num_layers, self.block_size
        )
        written = mode.written_blocks(step)
        if written is None:
            return []
        if mode.rewrites_end(step):
            self.done.add(request.request_id)
        return order[:written]
