"""A request's blocks viewed as one-head pages of vLLM's whole KV buffer, any of which may serve any layer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def drop_blocks(blocks: list[int | None], keep: set[int]) -> list[int]:
    """Mark every live block-table position not in ``keep`` released (None); returns their block ids."""
    dropped = []
    for position, block in enumerate(blocks):
        if block is not None and position not in keep:
            dropped.append(block)
            blocks[position] = None
    return dropped


class BlockPages:
    """The blocks one request holds, as pages of the global page space, and the free ones among them.

    vLLM 0.32 keeps every layer's cache in one buffer; layer ``l``, block
    ``b``, head ``h`` is page ``layer_base[l] + b*H + h``. A request whose
    layers keep different amounts (OmniKV's host tier, PoD) packs its pages
    into the blocks it may write, in ``order`` (``write_order``: with prefix
    caching, never a block other requests read, and blocks still in the prefix
    cache last), and hands the rest back; it reads from every block.
    Subclasses say which pages they use (``pages_in_use``).
    """

    def __init__(
        self,
        layer_base: Sequence[int],
        num_heads: int,
        block_size: int,
        blocks: Sequence[int],
        order: Sequence[int] | None = None,
    ):
        """``order``: the block-table positions the request may write, in the order it fills them;
        by default every block, in table order."""
        self.layer_base = list(layer_base)
        self.num_layers = len(self.layer_base)
        self.num_heads = num_heads
        self.block_size = block_size
        self.blocks: list[int | None] = [int(b) for b in blocks]
        self.order = list(range(len(self.blocks)) if order is None else order)
        self.free: list[int] = []

    def _page(self, layer: int, block: int, head: int) -> int:
        return self.layer_base[layer] + block * self.num_heads + head

    def _block_pages(self, block: int) -> list[int]:
        return [self._page(layer, block, h) for layer in range(self.num_layers) for h in range(self.num_heads)]

    def pages_in_use(self) -> Iterable[int]:
        raise NotImplementedError

    def add_blocks(self, blocks: Sequence[int]) -> None:
        """Blocks vLLM appended as the request grew: all their pages are free."""
        for block in blocks:
            self.blocks.append(int(block))
            self.free.extend(reversed(self._block_pages(int(block))))

    def release_except(self, keep: set[int]) -> int:
        """Stop using every block-table position not in ``keep``; returns how many were live."""
        dropped = drop_blocks(self.blocks, keep)
        gone = {p for block in dropped for p in self._block_pages(block)}
        if gone.intersection(self.pages_in_use()):
            raise RuntimeError("a released block still holds pages of the request")
        self.free = [p for p in self.free if p not in gone]
        return len(dropped)

    def live_blocks(self) -> int:
        return sum(block is not None for block in self.blocks)
