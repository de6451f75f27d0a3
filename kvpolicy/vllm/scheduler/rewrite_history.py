"""When each request's blocks stopped holding their tokens, as the scheduler learns it.

The connector counts the scheduler's steps and, from each report, records the step a request was first
relocated, evicted from or offloaded in: from then on its kept blocks hold pages, not the tokens their hashes
name, and a connector that copies blocks by hash (``prefix_offload.py``) keeps what it copied after that out of
its store. Kept only while such a reader is installed (``watch``); exact only under vLLM's synchronous
scheduler, which ``startup/args.py`` keeps wherever a reader runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Relocations:
    """``step``: scheduling steps so far; ``first_step``: request -> the step it was first relocated in."""

    step: int = 0
    watched: bool = False
    first_step: dict[str, int] = field(default_factory=dict)

    def watch(self) -> None:
        self.watched = True

    def next_step(self) -> None:
        self.step += 1

    def record(self, req_id: str) -> None:
        if self.watched:
            self.first_step.setdefault(req_id, self.step)

    def relocated_in(self, req_id: str) -> int | None:
        return self.first_step.get(req_id)

    def forget(self, req_id: str) -> None:
        self.first_step.pop(req_id, None)


#: The scheduler's, one per engine-core process.
RELOCATIONS = Relocations()
