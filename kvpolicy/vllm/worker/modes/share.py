"""Share (PoD): decode rows attend per KV head with the distant tokens' logits of a lower layer.

A PoD request is read with full attention (stock). ``Share`` follows each request (``SharedRequest``): after the
step that completes it, its tokens move into ``SharedPages`` over the whole KV buffer (everything in each block's
lowest layer, the proximal tokens elsewhere, distant values two per slot) and the connector hands back the blocks
the layout frees. In decode ``SharingPath`` has each layer write its new K/V and make one ``KVOps.pod_attention``
call for every decode row and KV head (eq. 3-4): a block's lowest layer stores its distant logits for the layers
above, which attend over their proximal keys plus those logits and their own distant values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvpolicy.paging import DecodeTables, DistantLogitRows, SharedLayoutPlan, SharedPages, layout_blocks
from kvpolicy.vllm.messages import BlockRelease
from kvpolicy.vllm.worker.modes.base import HostBatch, ModePath, ModeState, RequestStep, Row, StepShape
from kvpolicy.vllm.worker.step import HeadRows, PlatformAttend, PlatformWrite, PodDecodeCall, SharedBatch, SharingStep


@dataclass
class SharedRequest:
    """One request of PoD: its ``pages`` once laid out; ``uncompressed``: its own blocks could not hold
    the layout, it stays on the stock path."""

    pages: SharedPages | None = None
    uncompressed: bool = False


class Share(ModeState[SharedRequest]):
    """PoD's requests, from the step that lays them out on, and the builder of their steps."""

    def new_request(self) -> SharedRequest:
        return SharedRequest()

    def pages_of(self, request: SharedRequest) -> SharedPages | None:
        return request.pages

    @functools.cached_property
    def keeps_distant_keys(self) -> np.ndarray:
        """[layers, heads]: PoD's (layer, head) pairs that are the lowest of their block."""
        return np.array(self.policy.layer_groups().keeps_distant_keys())

    @functools.cached_property
    def distant_logit_rows(self) -> DistantLogitRows:
        return DistantLogitRows.of(np.array(self.policy.layer_groups().lowest()))

    def build(self, batch: HostBatch, shape: StepShape) -> SharingStep | None:
        """Decode rows of laid-out requests attend on the sharing path; a request whose computed tokens
        are all in the cache this step, with a page's worth of distant tokens, is laid out after the
        step's last layer (its blocks past the layout go back to vLLM). With prefix caching the layout
        writes only its own blocks (``write_order``); a prompt whose own blocks cannot hold it stays on
        the stock path."""
        decoding: list[tuple[Row, SharedPages]] = []
        layouts: list[SharedLayoutPlan] = []
        for row in self.rows(batch):
            request = self.requests.get(row.req_id)
            if row.idle or (request is not None and request.uncompressed):
                continue
            if request is not None and request.pages is not None:
                if row.query_len != 1:
                    raise RuntimeError("a PoD request takes one new token per step once it is laid out")
                pages = request.pages
                pages.add_blocks(
                    batch.block_table[row.index, len(pages.blocks) : shape.num_blocks(row.seq_len)].tolist()
                )
                decoding.append((row, pages))
                continue
            layout = self._layout(row, batch, shape)
            if layout is not None:
                layouts.append(layout)
        if not (decoding or layouts):
            return None
        away = [row.index for row, _ in decoding]
        step = SharingStep(shape.stock_batch(batch, away), layouts=layouts)
        if decoding:
            step.shared = self._shared_batch(decoding, batch, shape)
        return step

    @staticmethod
    def written_blocks(step: RequestStep) -> int | None:
        """The mode's rule: a request whose computed tokens are all in the cache after the step, with a
        page's worth of distant tokens, is laid out into the blocks it packs into; else nothing is written."""
        distant = step.policy.distant_range(step.end)
        if not step.complete or distant[1] - distant[0] < step.block_size:
            return None  # a prompt chunk, or too few distant tokens to free a page
        keeps = np.array(step.policy.layer_groups().keeps_distant_keys())
        return layout_blocks(keeps, step.block_size, step.end, distant)

    def _layout(self, row: Row, batch: HostBatch, shape: StepShape) -> SharedLayoutPlan | None:
        """The layout of a request read whole this step, with a page's worth of distant tokens; None otherwise."""
        needed = self.written_blocks(self.request_step(row, shape))
        if needed is None:
            return None
        num_blocks = shape.num_blocks(row.seq_len)
        blocks = batch.block_table[row.index, :num_blocks].tolist()
        order, shared = self.worker.writable_blocks(row.req_id, num_blocks)
        if shared and needed > len(order):
            self.leave_uncompressed(row.req_id)
            return None
        layer_base = self.worker.page_space().layer_base
        pages = SharedPages(layer_base, shape.num_kv_heads, shape.block_size, blocks, self.keeps_distant_keys, order)
        layout = pages.layout(row.seq_len, self.policy.distant_range(row.seq_len))
        self.track(row.req_id).pages = pages
        self.worker.releases[row.req_id] = BlockRelease(pages, length=row.seq_len, prompt_done=True)
        return layout

    def _shared_batch(self, decoding: list[tuple[Row, SharedPages]], batch: HostBatch, shape: StepShape) -> SharedBatch:
        heads = shape.num_kv_heads
        token_idx = torch.tensor([row.first_token for row, _ in decoding], dtype=torch.int64)
        slots = torch.stack([pages.append() for _, pages in decoding], dim=1)  # [layers, rows, heads]
        return SharedBatch(
            token_idx,
            HeadRows(
                token_idx.repeat_interleave(heads),
                torch.arange(heads).repeat(len(decoding)),
                len(decoding) == int(batch.query_start_loc[-1]),
            ),
            [pages for _, pages in decoding],
            slots.reshape(shape.num_layers, -1),
            DecodeTables.of([pages for _, pages in decoding], self.distant_logit_rows),
        )


class SharingPath(ModePath):
    mode: Share

    @functools.cached_property
    def _lowest(self) -> np.ndarray:
        """[layer, head]: the lowest layer of the block each (layer, head) belongs to."""
        return np.array(self.worker.policy.layer_groups().lowest())

    @functools.cached_property
    def _sharing_heads(self) -> np.ndarray:
        """[layer]: how many of its KV heads attend with a lower layer's distant logits."""
        return (DistantLogitRows.of(self._lowest).read >= 0).sum(axis=1)

    def write(self, layer, key, value, kv_cache, step: SharingStep, platform_write: PlatformWrite) -> None:
        """The decode rows' new K/V at the end of their main sequences; the platform writes the rest."""
        shared = step.shared
        if not self.platform_writes(shared, step.stock.token_idx, key, platform_write):
            return
        pages = self.worker.page_space().pages
        self.ops.write(layer, pages, key, value, shared.rows, shared.slots[self.layer_index(layer)])

    def attend(self, layer, query, out, kv_cache, step: SharingStep, platform_attend: PlatformAttend) -> None:
        """Stock rows as usual, decode rows per KV head (eq. 3-4); after the last layer, lay out the prompts
        that completed this step."""
        layer_idx = self.layer_index(layer)
        if step.shared is None:
            platform_attend()
        else:
            if step.stock.token_idx.numel():  # no call for a step whose every row decodes laid out
                self.ops.attend(layer, query, out, kv_cache, step.stock)
            self._attend_shared(layer, layer_idx, query, out, step.shared)
        if step.layouts and layer_idx == len(self._lowest) - 1:
            self._lay_out(layer, step)

    def _attend_shared(self, layer, layer_idx: int, query, out, shared: SharedBatch) -> None:
        tables = shared.tables
        group = query.shape[1] // self._lowest.shape[1]
        if shared.distant_logits is None:  # the step's first layer
            shared.distant_logits = torch.empty(
                tables.logit_rows, group, tables.max_distant, dtype=torch.float32, device=query.device
            )
        tau = self.worker.policy.tau
        call = PodDecodeCall(
            shared.rows.token_of, shared.rows.head_of, tables.layer(layer_idx), shared.distant_logits, tau
        )
        skipped = self.ops.pod_attention(layer, query, out, self.worker.page_space().pages, call)
        self.worker.counters["pod_distant_evaluated"] += (
            int(self._sharing_heads[layer_idx]) * len(shared.requests) * group
        )
        if tau is not None:
            self.worker.count_on_device("pod_distant_skipped", skipped.sum())

    def _lay_out(self, layer, step: SharingStep) -> None:
        """Move each completed prompt into its shared layout: every source read before any destination is written."""
        pages = self.worker.page_space().pages
        read = []
        for plan in step.layouts:
            keys, values = self.ops.gather(layer, pages, plan.tokens.src)
            pairs = plan.values
            if pairs.dst.numel():
                even = self.ops.gather_values(layer, pages, pairs.even)
                odd = self.ops.gather_values(layer, pages, pairs.odd)
            else:
                even = odd = None
            read.append((plan, keys, values, even, odd))
        for plan, keys, values, even, odd in read:
            self.ops.scatter(layer, pages, plan.tokens.dst, keys, values)
            if even is not None:
                self.ops.scatter(layer, pages, plan.values.dst, even, odd)
            self.worker.counters["pod_layouts"] += 1
