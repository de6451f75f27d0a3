"""Scheduler side: the blocks a step may rewrite, evicted from vLLM's prefix cache when the step is scheduled.

Under vLLM's asynchronous scheduler step N+1 is scheduled before step N's report arrives, so the blocks a
relocation, PoD's layout or an offload may rewrite must leave the prefix cache in advance; how many a step
writes is its mode's rule (``ModeState.written_blocks``), the same code the worker's mode decides with
(docs/architecture.md has the whole story). This module keeps no rule of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpolicy.vllm.scheduler.request_modes import RequestModes


@dataclass
class RewriteBound:
    """What each scheduled step of a request may rewrite, its mode's rule asked through ``modes``."""

    modes: RequestModes
    #: Requests whose rewritable blocks left the prefix cache for good (until a preemption frees them).
    done: set[str] = field(default_factory=set)

    def positions(self, request, num_scheduled: int, order: list[int]) -> list[int]:
        """The positions of ``order`` the step that brings ``request`` to ``num_computed_tokens +
        num_scheduled`` tokens may rewrite, as the worker's mode decides it ([] when none)."""
        if request.request_id in self.done:
            return []
        found = self.modes.step(request, request.num_computed_tokens + num_scheduled, num_scheduled)
        if found is None:
            return []
        mode, step = found
        written = mode.written_blocks(step)
        if written is None:
            return []
        if mode.rewrites_end(step):
            self.done.add(request.request_id)
        return order[:written]
