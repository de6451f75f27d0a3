"""The messages kvpolicy's connector carries between the scheduler and the workers, each step.

Scheduler -> workers: ``KVPolicyConnectorMetadata``, which blocks of a prompt being read other requests
share. Workers -> scheduler: the blocks their requests gave up.

Modes record a ``BlockRelease`` for each request whose pages changed in a step; after the step's
forward the worker turns them into one ``BlockReleases`` (``WorkerState.take_releases``), which the
connector carries to the scheduler, where vLLM frees the blocks (``connector.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpolicy.paging import OffloadedRequest, RequestPages, SharedPages
from kvpolicy.vllm.internals import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class BlockRelease:
    """A request whose pages changed this step: after the forward, the connector hands vLLM back the
    blocks it no longer holds.

    ``keep``: the block-table positions it keeps, when the step's plan fixed them (an offload); else
    ``pages.blocks_to_keep(length)`` once every layer has moved, with ``length`` its length after the
    step when its prompt is read whole. ``prompt_done``: its prompt was relocated or laid out (else an
    eviction pass, or an offload).
    """

    pages: RequestPages | SharedPages | OffloadedRequest
    keep: set[int] | None = None
    length: int | None = None
    prompt_done: bool = False


@dataclass
class BlockReleases(KVConnectorWorkerMetadata):
    """Worker -> scheduler: of its first ``seen[req]`` block-table positions (those the step had),
    a relocated request holds only ``keep[req]``."""

    keep: dict[str, set[int]]
    seen: dict[str, int]

    def aggregate(self, other: BlockReleases) -> BlockReleases:
        # Tensor-parallel ranks hold different heads: keep what any rank needs.
        for req_id, keep in other.keep.items():
            self.keep[req_id] = keep | self.keep.get(req_id, set())
            self.seen[req_id] = min(other.seen[req_id], self.seen.get(req_id, other.seen[req_id]))
        return self


@dataclass
class KVPolicyConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: ``sharing[req]``, the block-table positions of a prompt being
    read that other requests read, and those in the prefix cache (``block_sharing``)."""

    sharing: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)


def own_metadata(metadata: KVConnectorMetadata | None) -> KVPolicyConnectorMetadata | None:
    """kvpolicy's part of a step's connector metadata: all of it, or its child's in vLLM's
    ``MultiConnector`` (``MultiKVConnectorMetadata.metadata``, in the connectors' order)."""
    for part in (metadata, *getattr(metadata, "metadata", ())):
        if isinstance(part, KVPolicyConnectorMetadata):
            return part
    return None
