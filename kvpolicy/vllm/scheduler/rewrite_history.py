"""When each request's blocks stopped holding their tokens, as the scheduler learns it.

kvpolicy's connector counts the scheduler's steps (one per metadata it builds)
and, from each step's report, records the step a request was first relocated,
evicted from or offloaded in: from then on its kept blocks hold pages, not
the tokens their hashes name. A KV connector that copies blocks by their
hashes (vLLM's offloading connector, ``prefix_offload.py``) reads this to
keep what it copied after that point out of its store. Only kept while such a
reader is installed (``watch``), and forgotten when the reader is done with a
request.

The step a report names is the step it came from only when vLLM reads a
step's report before it schedules the next (its synchronous scheduler, one
stage): ``args.py`` keeps it so wherever a reader runs.
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
