"""Which pipeline stage a worker runs: set once by the worker hook, read by the backends and the connector."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PipelineStage:
    """A stage holds, writes and compresses only its own layers, counted from ``first_layer`` (0 and
    rank 0 without pipeline parallelism); requests are counted by the first stage only."""

    rank: int = 0
    first_layer: int = 0


STAGE = PipelineStage()
