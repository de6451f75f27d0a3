"""Scheduler side: a request's policy and its mode's rules, asked as the worker's mode asks them (``modes/``), so
that the scheduler keeps no rule of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpolicy.config import REQUEST_POLICY_KEY, KVPolicyConfig
from kvpolicy.policies import Policy
from kvpolicy.vllm.worker.modes import MODES, ModeState, RequestStep
from kvpolicy.vllm.worker.modes.decode_passes import DecodePasses


@dataclass
class RequestModes:
    """For one engine's configuration and model (``num_kv_heads`` per rank, ``num_layers`` on this stage): each
    request's policy (its ``kv_policy``, else the server's; made once a name) and the step its mode reads."""

    config: KVPolicyConfig
    num_kv_heads: int
    num_layers: int
    block_size: int
    _policies: dict[str, Policy] = field(default_factory=dict)

    def policy_of(self, request) -> Policy | None:
        """A request's policy; None for ``kv_policy: none``."""
        name = (request.sampling_params.extra_args or {}).get(REQUEST_POLICY_KEY, self.config.policy)
        if name == "none":
            return None
        if name not in self._policies:
            self._policies[name] = self.config.for_policy(name).make_policy()
        return self._policies[name]

    def step(self, request, end: int, query_len: int) -> tuple[type[ModeState], RequestStep] | None:
        """The request's mode and the step that brings it to ``end`` tokens (``query_len`` of them new), as
        the mode's rules read it; None when the request runs on the stock path."""
        policy = self.policy_of(request)
        if policy is None or policy.mode not in MODES:
            return None
        step = RequestStep.of(
            policy, self.config, request, end, query_len, self.num_kv_heads, self.num_layers, self.block_size
        )
        return MODES[policy.mode].state, step

    def decode_passes(self, request) -> DecodePasses | None:
        """When decode compresses the request, as its mode decides (``ModeState.decode_passes``); None: never."""
        found = self.step(request, request.num_tokens, 1)
        return None if found is None else found[0].decode_passes(found[1])

    def kept_after_reading(self, request) -> int | None:
        """The blocks a request keeps once the step that completes its read rewrites them (its mode's
        ``written_blocks``); None when that step rewrites none, or when its policy evicts at every prompt chunk
        (it never holds its whole prompt, only its budget and a chunk: the bound of ``startup/admission.py``)."""
        found = self.step(request, request.num_tokens, 1)
        if found is None or self.policy_of(request).schedule.per_chunk:
            return None
        return found[0].written_blocks(found[1])
