"""Room the scheduler keeps free for requests that grow after compression.

A relocated request holds its budget, then grows by a block per ``block_size`` generated tokens; vLLM
admits new requests by free blocks alone, and a prompt's first chunk's at that. The connector reserves, at each
admission (``patches.reserve_for_admissions``), the most blocks the running compressed requests will take at once,
and the blocks those still being read (the one admitted too) take until their prompt's end and after it.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def blocks_to_read(read: int, kept: int, final: int, table: int, block_size: int) -> int:
    """Blocks a request still takes past the ``table`` it has while its ``read`` tokens are read (chunk by
    chunk, each allocated as it comes), and after the read's rewrite keeps ``kept`` blocks of them, as it
    appends up to ``final`` tokens: the worse of the two moments."""
    read_blocks = -(-read // block_size)
    appended = max(-(-final // block_size) - read_blocks, 0)
    return max(max(read_blocks, kept + appended) - table, 0)
