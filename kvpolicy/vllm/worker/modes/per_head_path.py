"""The per-head path: requests a policy relocated attend as ``H`` one-head virtual sequences.

Each relocated request's KV head has its own pages and length per layer (block ``b``, head ``h`` is page ``b*H + h`` of
the layer's cache or, with one pool for every layer, of vLLM's whole KV buffer: ``Relocate.relocated_cache``); every
other row of the batch takes the platform's stock path. After attention, this layer relocates the prompts that
completed, runs eviction passes and adds new tokens' attention for policies that accumulate it, all through ``KVOps``.
Policies score where the cache is, slots go to the device once per read, and only each head's kept count comes back for
the page table (Ada-KV's counts and D2O's budgets: one read-back a prompt, after its last layer); positions stay logical, as vLLM computes
them.
"""

from __future__ import annotations

import torch

from kvpolicy.policies import PromptKV
from kvpolicy.vllm.worker.modes.base import ModePath
from kvpolicy.vllm.worker.modes.relocate import Relocate
from kvpolicy.vllm.worker.step import PerHeadBatch, PlatformAttend, PlatformWrite, RelocatingStep, Relocation


class PerHeadPath(ModePath):
    mode: Relocate

    def _rows(self, query: torch.Tensor, token_idx: torch.Tensor) -> torch.Tensor:
        """A copy of the query rows at the step's host indices, where the queries are: the indices from the
        step's staged copy (indexing with host indices copies them over with a blocking copy, which waits
        for the stream)."""
        return query[self.ops.on_device(token_idx, query.device)]

    def write(self, layer, key, value, kv_cache, step: RelocatingStep, platform_write: PlatformWrite) -> None:
        """The relocated rows' new K/V into their own pages; the platform writes the rest."""
        per_head = step.per_head
        if not self.platform_writes(per_head, step.platform_layout_tokens, key, platform_write):
            return
        cache = self.mode.relocated_cache(kv_cache)
        self.ops.write(layer, cache, key, value, per_head.rows, per_head.slots[self.layer_index(layer)])

    def attend(self, layer, query, out, kv_cache, step: RelocatingStep, platform_attend: PlatformAttend) -> None:
        """The layer's attention (the platform's alone when no row goes per head), then what follows it."""
        layer_idx = self.layer_index(layer)
        if step.per_head is None and not step.summed:
            platform_attend()
        else:
            self._attend(layer, layer_idx, query, out, kv_cache, step)
        self.after_attention(layer, layer_idx, query, kv_cache, step)

    def _attend(self, layer, layer_idx: int, query, out, kv_cache, step: RelocatingStep) -> None:
        """Stock rows in vLLM's layout, relocated rows per head, summed prompt chunks with their
        column sums; ``out`` [T, q_heads, D]."""
        if step.stock.token_idx.numel():  # no call for a step whose every row goes per head
            self.ops.attend(layer, query, out, kv_cache, step.stock)
        per_head = step.per_head
        if per_head is not None:
            batch = per_head.layers[layer_idx]
            self.ops.attend(layer, query, out, self.mode.relocated_cache(kv_cache), batch, per_head.rows)
        for chunk in step.summed:
            sums = self.ops.prompt_attention(layer, query, out, kv_cache, chunk)
            self.mode.add_column_sums(chunk.req_id, layer_idx, sums)

    def after_attention(self, layer, layer_idx: int, query, kv_cache, step: RelocatingStep) -> None:
        """Stash window queries, add new tokens' attention, relocate completed prompts, run eviction passes;
        after the last layer, pack requests whose layers share a pool into their fewest blocks."""
        for stash in step.window_stash:
            self.mode.stash_window(stash.req_id, layer_idx, self._rows(query, stash.token_idx))
        if step.per_head is not None and self.worker.policy.inputs.new_token_attention:
            self._add_attention(layer, query, kv_cache, layer_idx, step.per_head)
        if step.relocations:
            self._relocate(layer, layer_idx, query, kv_cache, step.relocations)
            if self.mode.pools_layers and layer_idx == step.relocations[0].pages.num_layers - 1:
                for relocation in step.relocations:
                    moves = relocation.pages.pack()
                    if moves.src.numel():
                        self.ops.move(layer, self.mode.relocated_cache(kv_cache), moves.src, moves.dst)

    def _add_attention(self, layer, query, kv_cache, layer_idx: int, per_head: PerHeadBatch) -> None:
        """Add each relocated request's new token's attention weights over its cache to its carried scores,
        for the whole batch in one operation (``CarriedScores.add``)."""
        if per_head.token_idx.numel() != len(per_head.req_ids):
            raise RuntimeError("policies that accumulate attention take one new token per request and step")
        batch = per_head.layers[layer_idx]
        weights = self.ops.new_token_weights(layer, query, self.mode.relocated_cache(kv_cache), batch, per_head.rows)
        slots = self.ops.on_device(per_head.carried_slots, weights.device)
        self.mode.scores.add(layer_idx, slots, weights)

    def _relocate(self, layer, layer_idx: int, query, kv_cache, relocations: list[Relocation]) -> None:
        """Move each finished prompt of this layer into per-head pages, keeping what the policy keeps.

        A policy whose layer budgets depend on every layer only observes here;
        the last layer then compresses every layer of the prompt.
        """
        num_layers = relocations[0].pages.num_layers
        for relocation in relocations:
            policy = relocation.policy
            if relocation.num_tokens is None:
                self._evict(layer, query, kv_cache, layer_idx, relocation)
                continue
            queries = None
            if policy.inputs.window or policy.inputs.attention:
                queries = self.mode.take_window(relocation.req_id, layer_idx, self._rows(query, relocation.window_idx))
            prompt, slots = self._prompt(layer, kv_cache, layer_idx, relocation, queries)
            counts = relocation.num_tokens, relocation.num_computed
            if not policy.observes_every_layer:
                self._compact(layer, kv_cache, layer_idx, relocation, prompt, slots, relocation.budget, None, *counts)
                continue
            observed = self.mode.observe(
                relocation.req_id, layer_idx, kv_cache, policy.observe(prompt, relocation.budget)
            )
            if layer_idx == num_layers - 1:
                caches, observations = zip(*(observed[i] for i in range(num_layers)))
                settled = policy.settle(list(observations), relocation.budget)
                for i, (cache, (budget, observation)) in enumerate(zip(caches, settled)):
                    earlier = (prompt, slots) if i == layer_idx else self._prompt(layer, cache, i, relocation, None)
                    self._compact(layer, cache, i, relocation, *earlier, budget, observation, *counts)

    def _evict(self, layer, query, kv_cache, layer_idx: int, relocation: Relocation) -> None:
        """An eviction pass: this layer's cache back to its budget, with what the policy carried (and, for a
        window policy's pass in decode, its window of generated queries, and their column sums if it reads
        attention too), if over it."""
        pages = relocation.pages
        carried = self.mode.requests[relocation.req_id].carried
        window = None
        if relocation.policy.inputs.window:  # taken in every layer, over budget or not: the next pass's start
            window = self.mode.take_window(relocation.req_id, layer_idx, self._rows(query, relocation.window_idx))
        length = int(pages.lengths[layer_idx, 0])
        budget = carried.budgets[layer_idx]
        if length <= budget:
            return
        keys, values, slots = self._read(layer, kv_cache, layer_idx, relocation, length, length)
        sums_window = window is not None and relocation.policy.inputs.attention
        cache = PromptKV(
            keys,
            window_queries=window,
            layer=layer_idx,
            num_layers=pages.num_layers,
            queries=window if sums_window else None,
            values=values,
            column_sums=self.ops.prompt_column_sums(keys, window) if sums_window else None,
            scores=self.mode.scores.read(layer_idx, carried.slot, length) if carried.scored[layer_idx] else None,
            threshold=carried.thresholds[layer_idx],
            heads=None if window is None else self.worker.head_group,
        )
        self._compact(layer, kv_cache, layer_idx, relocation, cache, slots, budget, None, length, length)

    def _read(self, layer, kv_cache, layer_idx: int, relocation: Relocation, num_tokens: int, num_slots: int):
        """The first ``num_tokens`` of each head of one layer of a request: keys, values, [heads, n, head_dim],
        on the cache's device; and the slots of each head's first ``num_slots`` tokens, [heads, num_slots],
        there too (the sources ``_compact`` moves from: ``num_slots`` covers output a preempted request
        recomputed past its prompt)."""
        heads = kv_cache.shape[1]
        slots = relocation.pages.current_slots(layer_idx, [torch.arange(num_slots)] * heads)
        slots = slots.view(heads, num_slots).to(kv_cache.device, non_blocking=True)
        read = slots[:, :num_tokens].reshape(-1)
        keys, values = self.ops.gather(layer, self.mode.relocated_cache(kv_cache), read)
        return keys.view(heads, num_tokens, -1), values.view(heads, num_tokens, -1), slots

    def _prompt(self, layer, kv_cache, layer_idx: int, relocation: Relocation, queries):
        """The prompt's K/V of one layer, read from the request's pages, with the queries the policy needs;
        and the slots of its tokens (``_read``)."""
        counts = relocation.num_tokens, relocation.num_computed
        keys, values, slots = self._read(layer, kv_cache, layer_idx, relocation, *counts)
        policy = relocation.policy
        column_sums = None
        if policy.inputs.attention and queries is not None:
            # Summed chunks' sums cover the prompt's first positions; stashed queries, its last ones.
            column_sums = self.mode.take_column_sums(relocation.req_id, layer_idx, keys.shape[1])
            unsummed = queries[:, relocation.summed_queries :]
            if unsummed.shape[1]:
                from_queries = self.ops.prompt_column_sums(keys, unsummed)
                column_sums = from_queries if column_sums is None else column_sums + from_queries
        prompt = PromptKV(
            keys,
            # The window's queries alone, for a policy that is handed every prompt query as well.
            window_queries=queries[:, -policy.window :] if policy.inputs.window and queries is not None else None,
            layer=layer_idx,
            num_layers=relocation.pages.num_layers,
            queries=queries if policy.inputs.attention else None,
            values=values,
            column_sums=column_sums,
            heads=self.worker.head_group,
        )
        return prompt, slots

    def _compact(
        self, layer, kv_cache, layer_idx, relocation, prompt, slots, budget, observation, num_tokens, num_computed
    ):
        """Pack what the policy keeps of one layer into per-head pages; write back K/V it rewrote.

        The policy chooses among the first ``num_tokens``; the rest, up to
        ``num_computed``, are kept. ``slots`` [heads, num_computed]: where
        each head's tokens sit now (``_read``), so the move sources are
        picked on the cache's device and only the kept counts reach the page
        table. A policy that evicts in decode, or a request decode compresses,
        carries the layer's budget, scores and threshold to its next pass.
        """
        heads, head_size = kv_cache.shape[1], kv_cache.shape[-1] // 2
        pages = relocation.pages
        policy = relocation.policy
        result = policy.compress(prompt, budget, observation)
        generated = torch.arange(num_tokens, num_computed, device=slots.device)
        kept = [torch.cat([chosen, generated]) for chosen in result.kept]
        src = torch.cat([head_slots[positions] for head_slots, positions in zip(slots, kept)])
        dst = pages.allot(layer_idx, [positions.numel() for positions in kept])
        cache = self.mode.relocated_cache(kv_cache)
        self.ops.move(layer, cache, src, dst)
        if result.keys is not None:
            rewritten = pages.current_slots(layer_idx, [torch.arange(chosen.numel()) for chosen in result.kept])
            keys, values = result.keys.reshape(-1, head_size), result.values.reshape(-1, head_size)
            self.ops.scatter(layer, cache, rewritten, keys, values)
        if policy.schedule.in_decode or self.mode.requests[relocation.req_id].decode is not None:
            carried = self.mode.carried(relocation.req_id)
            carried.budgets[layer_idx] = budget
            carried.scored[layer_idx] = result.scores is not None
            if result.scores is not None:
                # Output recomputed after a preemption has no scores yet.
                unseen = torch.zeros(heads, generated.numel(), dtype=torch.float64, device=result.scores.device)
                self.mode.scores.write(layer_idx, carried.slot, torch.cat([result.scores, unseen], dim=1))
            carried.thresholds[layer_idx] = result.threshold
