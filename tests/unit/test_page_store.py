"""The batch-wide page store: a step's appends over many rows at once equal each request's own, and moving rows
(``arrange``) moves everything a row holds."""

import numpy as np
import pytest
import torch

from kvpolicy.paging import PageStore, RequestPages

BS = 4


def relocated(layers: int, heads: int, blocks: list[int], store: PageStore | None, pooled: bool, rng) -> RequestPages:
    """A request whose prompt filled ``blocks``, each head keeping a random part of it."""
    base = [1000 * layer for layer in range(layers)] if pooled else None
    pages = RequestPages(layers, heads, BS, blocks, layer_base=base, store=store)
    prompt = len(blocks) * BS
    for layer in range(layers):
        pages.relocate(layer, [torch.arange(int(n)) for n in rng.integers(1, prompt // 2, size=heads)])
    if pooled:
        pages.pack()
    pages.release_except(pages.blocks_to_keep(prompt))
    return pages


def same_pages(a: RequestPages, b: RequestPages) -> None:
    assert a.head_pages == b.head_pages
    last = [[pages[-1] * BS if pages else 0 for pages in layer] for layer in a.head_pages]
    assert a.store.page_starts[:, a.row].tolist() == last
    assert a.lengths.tolist() == b.lengths.tolist()
    assert a.free == b.free


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_batch_append_equals_each_request_appending_alone(pooled, seed):
    rng = np.random.default_rng(seed)
    layers, heads = 3, 2
    store = PageStore(layers, heads, BS, pooled, rows=2)  # grows as requests come
    batch, alone, next_block = [], [], 0
    for _ in range(5):
        blocks = list(range(next_block, next_block + 6))
        next_block += 6
        state = rng.bit_generator.state
        batch.append(relocated(layers, heads, blocks, store, pooled, rng))
        rng.bit_generator.state = state
        alone.append(relocated(layers, heads, blocks, None, pooled, rng))
    for step in range(30):
        chosen = rng.permutation(len(batch))[: rng.integers(1, len(batch) + 1)]
        counts = rng.choice([1, 1, 1, 2, 5], size=chosen.size)
        while True:  # vLLM appends blocks as requests grow: the batch's in one call, each alone by itself
            short = [i for i in chosen if min(map(len, alone[i].free)) < 6 * heads * (layers if pooled else 1)]
            if not short:
                break
            count = int(rng.integers(1, 3))
            new_blocks = np.arange(next_block, next_block + len(short) * count).reshape(len(short), count)
            RequestPages.add_new_blocks([batch[i] for i in short], new_blocks)
            for i, blocks in zip(short, new_blocks.tolist()):
                alone[i].add_blocks(blocks)
                assert batch[i].free[-1][-len(blocks) * heads * (layers if pooled else 1) :] == [
                    (1000 * layer if pooled else 0) + block * heads + head
                    for block in blocks
                    for layer in (range(layers) if pooled else [0])
                    for head in range(heads)
                ]  # a block's pages, by layer when one pool holds every layer's
            next_block += new_blocks.size
        store.arrange([batch[i] for i in chosen])
        assert [batch[i].row for i in chosen] == list(range(chosen.size))
        slots = store.append(np.arange(chosen.size), counts)
        one_by_one = [alone[i].append(int(c)).transpose(0, 2, 1).reshape(layers, -1) for i, c in zip(chosen, counts)]
        assert np.array_equal(slots, np.concatenate(one_by_one, axis=1)), step
        for a, b in zip(batch, alone):
            same_pages(a, b)


def test_a_closed_row_is_reused_and_the_tables_grow_when_full():
    rng = np.random.default_rng(0)
    store = PageStore(2, 2, BS, pools_layers=False, rows=1)
    first = relocated(2, 2, [0, 1, 2], store, False, rng)
    second = relocated(2, 2, [3, 4, 5], store, False, rng)
    assert store.num_rows == 2 and {first.row, second.row} == {0, 1}
    row = first.row
    first.close()
    third = relocated(2, 2, [6, 7, 8], store, False, rng)
    assert third.row == row
    assert store.take_changes().resized, "the store grew since it was made"
    third.append(1)
    changes = store.take_changes()
    assert not changes.resized


def test_a_request_that_outgrows_its_blocks_is_refused():
    store = PageStore(1, 2, BS, pools_layers=False)
    pages = RequestPages(1, 2, BS, [0], store=store)
    pages.relocate(0, [torch.arange(BS), torch.arange(BS)])
    with pytest.raises(RuntimeError, match="no free page left in layer 0"):
        pages.append(1)
