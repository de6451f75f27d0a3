"""The ops interface: every tensor operation the per-head and selection paths perform on the cache.

A cache argument is a tensor ``[n, h, block_size, 2 * head_size]`` in vLLM's
logical order (a layer's cache, ``h`` = its KV heads; or the whole KV buffer as
one-head pages, ``h`` = 1), any physical strides the platform allocates; page
``p`` is index ``p // h``, head ``p % h``, and a slot is ``page * block_size +
token``. ``layer`` is vLLM's attention layer (the CPU ops read its ISA and KV
scales; its ``impl`` the layer's attention settings). One ops object serves every layer of a metadata
builder's group. Two implementations: ``CPUOps`` (vLLM's CPU kernels) and
``TritonOps`` (``triton_kernels/``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvpolicy.paging import PageCopies
from kvpolicy.vllm.worker.ops.staging import TableMirror
from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows, PodDecodeCall, Step, SummedChunk


class KVOps(ABC):
    """Attention over chosen pages, token moves, and the scores the policies need, on one platform."""

    #: Whether ``prompt_attention`` is implemented: the step builder then sends H2O/D2O prompt chunks there.
    sums_prompts = False

    @abstractmethod
    def plan(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        kv_heads: int,
        queries_per_kv: int,
    ) -> Any:
        """Prepare one attention call (``step.Planner``); the result travels in ``AttentionBatch.plan``."""

    def stage(self, step: Step, tables: TableMirror | None = None) -> None:  # noqa: B027 (a hook: most ops have nothing to stage)
        """Called once per step, after the builder made it: the ops may send its index tensors to where the
        cache is now, in one copy, rather than layer by layer (``ops/staging.py``); ``tables``: the mode's
        device copy of its page tables, brought up to date with the step's."""

    def fixed_decode_plan(self, rows: int, max_seq_len: int, queries_per_kv: int, head_size: int, device) -> Any:
        """The plan of a fixed-shape decode call (``modes/fixed_decode.py``): ``rows`` one-token one-head
        sequences, each at most ``max_seq_len`` long, launched with the same grid and the same memory at
        every step, whatever the lengths (what a CUDA graph replays)."""
        raise NotImplementedError(f"{type(self).__name__} does not run fixed-shape decode calls")

    def warm_up(self, layer, cache) -> None:  # noqa: B027 (a hook: ops that compile nothing have nothing to warm)
        """Once, before the first request: compile every variant of every kernel the ops can launch, over a
        few tokens of ``layer``'s ``cache``, so that none compiles in the middle of a run."""

    def on_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host tensor of the step where the cache is (the staged copy's view, when the ops staged one)."""
        return tensor.to(device, non_blocking=True)

    @abstractmethod
    def write(self, layer, cache, key, value, rows: HeadRows, slots) -> None:
        """Write K/V of virtual token ``i`` of ``rows`` at ``slots[i]``; key, value [T, H, D]."""

    @abstractmethod
    def attend(self, layer, query, out, cache, batch: AttentionBatch, rows: HeadRows | None = None) -> None:
        """Causal attention of one call, written into ``out`` [T, q_heads, D] at the call's queries only.

        ``batch.kv_heads > 1``: rows of vLLM's own layout (``rows`` None).
        ``batch.kv_heads == 1``: one-head virtual sequences; virtual token ``i`` is
        the query heads of KV head ``rows.head_of[i]`` of batch token ``rows.token_of[i]``.
        """

    @abstractmethod
    def gather(self, layer, cache, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows [n, D] of the tokens at ``slots``."""

    @abstractmethod
    def scatter(self, layer, cache, slots, keys, values) -> None:
        """Write K and V rows [n, D] at ``slots``."""

    def gather_values(self, layer, cache, slots) -> torch.Tensor:
        """V rows [n, D] of the tokens at ``slots`` (PoD packs distant values without their keys)."""
        return self.gather(layer, cache, slots)[1]

    def move(self, layer, cache, src, dst) -> None:
        """Every token at ``src[i]`` to ``dst[i]``; safe when the two overlap (all read before any write)."""
        keys, values = self.gather(layer, cache, src)
        self.scatter(layer, cache, dst, keys, values)

    def copy_pages(self, source: torch.Tensor, target: torch.Tensor, copies: PageCopies) -> int:
        """Whole pages ``copies.src`` of ``source`` into ``copies.dst`` of ``target``, pools viewed as
        [pages, page_elems] (the host pool and vLLM's KV buffer, either way, or the buffer into itself),
        every source read before any destination is written; in the order of the step's work. Returns how
        many pages it copies."""
        return copies.apply(source, target)

    def load_pages(self, source: torch.Tensor, target: torch.Tensor, copies: PageCopies) -> Any:
        """Start copying pages from the host pool into device pages (as ``copy_pages``) so the copy can
        overlap the layers before the one that reads them; ``wait_pages`` of the result before reading."""
        self.copy_pages(source, target, copies)
        return None

    def wait_pages(self, pending: Any) -> None:  # noqa: B027 (a hook: copies made in place have nothing to wait for)
        """Make the step's work wait for the pages ``load_pages`` started copying."""

    def prompt_column_sums(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor | None:
        """H2O/D2O's prompt scores from host tensors: ``kvpolicy.policies.h2o.attention_column_sums``
        of ``keys`` [kv_heads, n, D] and ``queries`` [q_heads, t, D]; None: the policy computes them."""
        return None

    def prompt_attention(self, layer, query, out, cache, chunk: SummedChunk) -> torch.Tensor:
        """Attend one request's prompt chunk (``query`` rows ``chunk.token_idx``, over the keys at
        ``chunk.slots``) into ``out``, and return the column sums of those queries' attention,
        [q_heads, keys so far] float64: one QK^T for both (the platform's attention returns no weights)."""
        raise NotImplementedError(f"{type(self).__name__} does not attend summed prompt chunks")

    @abstractmethod
    def new_token_weights(self, layer, query, cache, batch: AttentionBatch, rows: HeadRows) -> torch.Tensor:
        """Per one-head sequence of a decode call, its new token's attention weights over the
        sequence (its query heads averaged), [sequences, n] float64, 0 past each length."""

    @abstractmethod
    def context_attention(self, layer, query, out, cache, page_ids, token_idx, lengths) -> torch.Tensor:
        """A filter layer for OmniKV's decode rows: their attention over their whole context into ``out``
        [T, q_heads, D] (``page_ids`` [rows, kv_heads, pages] in ``cache``, ``token_idx`` the rows' query
        tokens), and OmniKV's eq. (3)-(4) with the last-token selector from the same weights: each context
        token's weight (max over query heads) summed page by page, [rows, pages] float64. One read of the
        keys where the platform's ops can."""

    def pod_attention(self, layer, query, out, cache, call: PodDecodeCall) -> torch.Tensor:
        """PoD's decode attention (eq. 3-4) of ``call``'s sequences into ``out`` [T, q_heads, D], over ``cache``
        as one-head pages of the whole KV buffer (``kvpolicy_triton.pod_attention``); returns [S, G] bool,
        the query heads whose distant part ``call.tau`` skipped."""
        raise NotImplementedError(f"{type(self).__name__} does not implement PoD's decode attention")
