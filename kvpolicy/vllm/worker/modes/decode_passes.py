"""The decode budget's rule: when decode compresses a prompt that was within its budget, and the form a policy
takes there. Read by the worker's ``Relocate`` (which runs the passes) and, through ``ModeState.decode_passes``,
by the scheduler (which reserves the blocks a request appends between two of them). docs/policies.md, "A decode
budget"."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

from kvpolicy.policies import Policy
from kvpolicy.policies.compose import SameBudget, UniformHeads
from kvpolicy.vllm.worker.modes.request_step import RequestStep


@dataclass(frozen=True)
class DecodePasses:
    """How decode compresses a prompt within its ``budget``: its first pass (a relocation) at the step that
    brings its cache to ``first`` tokens, then, for a policy that does not evict by itself (``repeats``),
    every ``period`` tokens. ``first`` is the first token of a page past the budget and the buffer (for
    the evicting policies, a page past the budget), so a pass frees a page vLLM just appended. The queries
    of the ``window`` steps up to a pass score it (stashed until then)."""

    budget: int
    first: int
    period: int
    window: int
    repeats: bool

    def due(self, end: int) -> bool:
        """A pass runs at the step that brings the cache to ``end`` tokens."""
        return end >= self.first and (end - self.first) % self.period == 0

    def observes(self, end: int) -> bool:
        """The step's query is stashed for the next pass (the pass's own step hands it over itself)."""
        ahead = self.first - end if end <= self.first else -(end - self.first) % self.period
        return 0 < ahead < self.window

    @property
    def kept_queries(self) -> int:
        """Window queries a pass keeps for the next one, when the window is longer than the period."""
        return max(self.window - self.period, 0) if self.repeats else 0

    def blocks_at_first_pass(self, final_tokens: int, block_size: int) -> int:
        """Blocks vLLM has given the request by its first pass (or by its end, ``final_tokens``, if sooner)."""
        return -(-min(final_tokens, self.first) // block_size)

    def blocks_between_passes(self, block_size: int) -> int:
        """The most blocks a compressed request holds past its budget's: those appended between two passes,
        and one part-filled."""
        return self.period // block_size + 1


def decode_passes_of(step: RequestStep) -> DecodePasses | None:
    """How decode compresses the request, if its prompt is within its budget (``--kv-decode-buffer``,
    ``kv_decode_buffer``; None: it stays whole). The evicting policies' first pass comes a page past
    the budget, as their later ones do; the others' each time the cache passes the budget and the
    buffer, at the next page boundary. Window policies score with their window of generated queries,
    policies that accumulate attention with the queries since the budget was crossed."""
    config, policy = step.config, step.policy
    budget = config.decode_budget(step.prompt_len, step.budget_arg) if config.compresses_in_decode else None
    buffer = config.decode_buffer if step.decode_buffer_arg is None else step.decode_buffer_arg
    if budget is None or buffer == 0:
        return None
    page = step.block_size
    if policy.schedule.in_decode:
        return DecodePasses(
            budget, budget + page, page, page if policy.inputs.new_token_attention else 0, repeats=False
        )
    buffer = page if buffer is None else buffer
    first = -(-(budget + buffer) // page) * page + 1
    window = policy.window if policy.inputs.window else 0
    return DecodePasses(budget, first, -(-buffer // page) * page, window, repeats=True)


def decode_form(policy: Policy) -> Policy:
    """The policy as decode passes apply it: the same count in every head of a layer (a head allocator
    such as Ada-KV's would leave heads of different lengths, which the next pass could not read as one),
    and the same budget in every layer (D2O's inverse-variance budgets, from the attention of the few
    queries a pass in decode has, left whole layers at 0)."""
    heads, layers = getattr(policy, "heads", UniformHeads()), getattr(policy, "layers", SameBudget())
    if isinstance(heads, UniformHeads) and not layers.across_layers:
        return policy
    return _decode_form(policy)


@functools.cache
def _decode_form(policy: Policy) -> Policy:
    form = copy.copy(policy)
    object.__setattr__(form, "heads", UniformHeads())
    if policy.layers.across_layers:
        object.__setattr__(form, "layers", SameBudget())
    return form
