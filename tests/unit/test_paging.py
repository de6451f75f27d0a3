"""Page tables and token moves, on plain tensors (no vLLM)."""

import numpy as np
import pytest
import torch

from kvpolicy.paging import PageLayout, RequestPages, stock_page_tables, stock_slots, write_order

BS, D, H = 4, 3, 2


def transposed_k_layout() -> PageLayout:
    """A page whose K half is stored [D, BS] (like the CPU vec ISA) and V half [BS, D]."""
    k_tok = torch.arange(BS).repeat(D)  # element e = d*BS + t
    k_dim = torch.arange(D).repeat_interleave(BS)
    v_tok = torch.arange(BS).repeat_interleave(D)
    v_dim = torch.arange(D).repeat(BS)
    return PageLayout.from_token_and_dim_maps(torch.cat([k_tok, v_tok]), torch.cat([k_dim, v_dim]))


def test_layout_offsets_follow_the_packing():
    layout = transposed_k_layout()
    assert layout.k_offsets[1, 2].item() == 2 * BS + 1
    assert layout.v_offsets[1, 2].item() == BS * D + 1 * D + 2


def test_scatter_then_gather_round_trips_exactly():
    layout = transposed_k_layout()
    pages = torch.zeros(5, layout.page_elems)
    slots = torch.tensor([0, 5, 11, 19, 3])
    k, v = torch.randn(5, D), torch.randn(5, D)
    layout.scatter(pages, slots, k, v)
    k2, v2 = layout.gather(pages, slots)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_page_keys_equal_token_gathers_for_affine_and_scrambled_layouts():
    """The strided view (affine K, as the vec ISAs write it) and the element pick (any layout) read the same keys."""
    affine = transposed_k_layout()
    scramble = torch.randperm(BS * D, generator=torch.Generator().manual_seed(0))
    scrambled = PageLayout(BS, D, affine.k_offsets.reshape(-1)[scramble].view(BS, D), affine.v_offsets)
    assert affine.affine_keys == (0, 1, BS) and scrambled.affine_keys is None
    page_ids = torch.tensor([[3, 0, 5], [1, 1, 2]])
    for layout in (affine, scrambled):
        pages = torch.randn(6, layout.page_elems)
        slots = (page_ids[..., None] * BS + torch.arange(BS)).reshape(2, -1)
        expected = torch.stack([layout.gather(pages, row)[0] for row in slots])
        assert torch.equal(layout.page_keys(pages, page_ids), expected)
        assert torch.equal(layout.page_key_blocks(pages, page_ids).reshape(2, -1, D), expected)


def test_relocate_packs_heads_from_the_first_block():
    pages = RequestPages(num_layers=1, num_heads=H, block_size=BS, blocks=[7, 3, 9])
    keep = [torch.tensor([0, 2, 5]), torch.tensor([1, 3, 4, 6, 8, 10])]
    moves = pages.relocate(0, keep)
    # Stock source: token i of head h is page blocks[i // BS] * H + h, offset i % BS.
    assert moves.src.tolist() == [
        (7 * H + 0) * BS + 0,
        (7 * H + 0) * BS + 2,
        (3 * H + 0) * BS + 1,
        (7 * H + 1) * BS + 1,
        (7 * H + 1) * BS + 3,
        (3 * H + 1) * BS + 0,
        (3 * H + 1) * BS + 2,
        (9 * H + 1) * BS + 0,
        (9 * H + 1) * BS + 2,
    ]
    # Destinations: head 0 takes page 14, head 1 pages 15 and 6 (block 7, then block 3).
    assert pages.head_pages[0] == [[14], [15, 6]]
    assert pages.lengths[0].tolist() == [3, 6]
    assert pages.free[0] == [7, 18, 19]
    assert moves.dst.tolist() == [56, 57, 58, 60, 61, 62, 63, 24, 25]


def test_append_takes_free_pages_and_new_blocks():
    pages = RequestPages(num_layers=2, num_heads=H, block_size=BS, blocks=[1])
    for layer in range(2):
        pages.relocate(layer, [torch.arange(BS), torch.arange(BS)])
    pages.add_blocks([4])
    slots = pages.append()
    assert slots.tolist() == [[[8 * BS, 9 * BS]], [[8 * BS, 9 * BS]]]
    assert pages.lengths.tolist() == [[BS + 1, BS + 1], [BS + 1, BS + 1]]
    assert pages.store.table_of_rows(pages.row)[0, :, :3].tolist() == [[2, 8, 0], [3, 9, 0]]


def test_append_of_a_chunk_fills_the_last_page_then_takes_free_ones():
    pages = RequestPages(num_layers=1, num_heads=H, block_size=BS, blocks=[1, 4])
    pages.relocate(0, [torch.arange(BS - 1), torch.arange(2)])
    slots = pages.append(3)
    # Block 1 holds pages 2 (head 0) and 3 (head 1); block 4's pages 8 and 9 are free.
    assert pages.head_pages[0] == [[2, 8], [3, 9]]
    assert slots[0, :, 0].tolist() == [2 * BS + BS - 1, 8 * BS, 8 * BS + 1]
    assert slots[0, :, 1].tolist() == [3 * BS + 2, 3 * BS + 3, 9 * BS]
    assert pages.lengths.tolist() == [[BS + 2, 5]]


def test_appended_slots_are_where_the_tokens_are_read_back():
    """Decode takes slots from the page-table array; reads take them from the page lists: both agree."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        blocks = rng.permutation(64)[:4].tolist()
        pages = RequestPages(num_layers=3, num_heads=H, block_size=BS, blocks=blocks)
        for layer in range(3):
            pages.relocate(
                layer, [torch.from_numpy(np.sort(rng.permutation(4 * BS)[: rng.integers(0, 2 * BS)])) for _ in range(H)]
            )
        for step in range(12):
            pages.add_blocks([64 + step])  # H pages per layer: room for the BS tokens a head may take
            count = int(rng.choice([1, 1, 3]))
            slots = pages.append(count)
            for layer in range(3):
                ends = pages.lengths[layer]
                new = [torch.arange(int(end) - count, int(end)) for end in ends]
                assert pages.current_slots(layer, new).tolist() == slots[layer].T.reshape(-1).tolist()
            width = pages.store.width
            table = pages.store.table_of_rows(pages.row)
            for layer in range(3):
                for head in range(H):
                    held = pages.head_pages[layer][head]
                    assert table[layer, head].tolist() == held + [0] * (width - len(held))


def test_second_relocation_reads_from_per_head_pages():
    pages = RequestPages(num_layers=1, num_heads=1, block_size=BS, blocks=[2, 5])
    pages.relocate(0, [torch.arange(6)])
    moves = pages.relocate(0, [torch.tensor([1, 5])])
    assert moves.src.tolist() == [2 * BS + 1, 5 * BS + 1]
    assert moves.dst.tolist() == [2 * BS, 2 * BS + 1]
    assert pages.free[0] == [5]


def test_layout_moves_tokens_between_pages_like_the_cache_would():
    layout = transposed_k_layout()
    cache = torch.zeros(4 * H, layout.page_elems)
    pages = RequestPages(num_layers=1, num_heads=H, block_size=BS, blocks=[0, 1])
    keys = torch.randn(H, 2 * BS, D)
    values = torch.randn(H, 2 * BS, D)
    every = torch.arange(2 * BS)
    stock = pages.current_slots(0, [every] * H)
    layout.scatter(cache, stock, keys.reshape(-1, D), values.reshape(-1, D))
    keep = [torch.tensor([0, 7]), torch.tensor([2, 3, 4, 5, 6])]
    moves = pages.relocate(0, keep)
    k, v = layout.gather(cache, moves.src)
    layout.scatter(cache, moves.dst, k, v)
    for head in range(H):
        n = keep[head].numel()
        got_k, got_v = layout.gather(
            cache, pages.current_slots(0, [torch.arange(n) if h == head else torch.arange(0) for h in range(H)])
        )
        assert torch.equal(got_k, keys[head, keep[head]])
        assert torch.equal(got_v, values[head, keep[head]])


def test_release_frees_the_blocks_no_layer_uses():
    pages = RequestPages(num_layers=2, num_heads=H, block_size=BS, blocks=[5, 6, 7, 8, 9])
    pages.relocate(0, [torch.arange(3), torch.arange(2)])
    pages.relocate(1, [torch.arange(5), torch.arange(4)])  # 2 + 1 pages: both in the first two blocks
    assert pages.blocks_to_keep() == {0, 1, 2}  # ceil(3 / 2) + 1 spare
    assert pages.release_except({0, 1, 2}) == 2
    assert pages.blocks == [5, 6, 7, None, None]
    assert all(p < 16 for free in pages.free for p in free)
    pages.add_blocks([11])
    assert pages.free[0][-2:] == [22, 23]
    moves = pages.relocate(1, [torch.arange(1), torch.arange(1)])
    assert moves.dst.max().item() < 16 * BS


def test_write_order_never_writes_shared_blocks_and_cached_ones_last_from_the_end():
    # Blocks 0-2 are read by another request, 3-5 are in the prefix cache, 6-7 are this request's alone.
    assert write_order(8, shared=[0, 1, 2], cached=[1, 2, 3, 4, 5]) == [6, 7, 5, 4, 3]
    assert write_order(3) == [0, 1, 2]


def test_relocation_writes_only_the_blocks_of_its_order_and_keeps_them():
    blocks = [10, 11, 12, 13, 14]
    pages = RequestPages(
        num_layers=2, num_heads=H, block_size=BS, blocks=blocks, order=write_order(5, shared=[0, 1], cached=[2, 3])
    )
    every = [torch.arange(5 * BS)] * H
    sources = pages.current_slots(0, every)
    moves = pages.relocate(0, [torch.arange(3 * BS), torch.arange(BS)])  # 3 + 1 pages: blocks 14 and 13
    pages.relocate(1, [torch.arange(2), torch.arange(2)])
    written = {int(slot) // BS // H for slot in moves.dst}
    assert written == {14, 13}
    assert torch.equal(moves.src, torch.cat([sources[: 3 * BS], sources[5 * BS : 6 * BS]]))
    keep = pages.blocks_to_keep()
    assert keep == {4, 3, 2}  # two blocks of pages and the spare, in write order
    assert pages.release_except(keep) == 2
    assert pages.blocks == [None, None, 12, 13, 14]
    pages.add_blocks([15])
    assert pages.order == [4, 3, 2, 5]


@pytest.mark.parametrize("seed", range(6))
def test_exact_spare_pages_last_until_vllm_appends_blocks(seed):
    """Kept blocks hold a spare page for each head that fills its page before vLLM's next block, and
    no more: decoding on, with a block appended every ``BS`` tokens as vLLM does, never runs out."""
    gen = torch.Generator().manual_seed(seed)
    length = 7 * BS + int(torch.randint(0, BS, (1,), generator=gen))
    pages = RequestPages(num_layers=2, num_heads=H, block_size=BS, blocks=list(range(8)))
    for layer in range(2):
        counts = torch.randint(1, 3 * BS, (H,), generator=gen)
        pages.relocate(layer, [torch.arange(int(n)) for n in counts])
    keep = pages.blocks_to_keep(length)
    pages.release_except(keep)
    needed_pages = int(pages._page_counts().sum(axis=1).max())
    assert len(keep) in (-(-needed_pages // H), -(-needed_pages // H) + 1)
    next_block = 8
    for _ in range(3 * BS):
        if length % BS == 0:
            pages.add_blocks([next_block])
            next_block += 1
        pages.append(1)
        length += 1


def test_a_spare_page_only_for_heads_that_fill_their_page_before_the_next_block():
    pages = RequestPages(num_layers=1, num_heads=H, block_size=BS, blocks=list(range(4)))
    pages.relocate(0, [torch.arange(BS), torch.arange(BS)])  # both heads' pages are full
    assert len(pages.blocks_to_keep(3 * BS)) == 1  # vLLM's next block comes with the next token
    assert len(pages.blocks_to_keep(3 * BS + 2)) == 2  # two tokens first: each head takes a spare page
    assert len(pages.blocks_to_keep(None)) == 2  # a prompt still being read: one whole spare block


def _apply(space: torch.Tensor, moves) -> None:
    """Token moves on a page space of token labels [pages * BS]: every source read before any write."""
    space[moves.dst] = space[moves.src].clone()


@pytest.mark.parametrize("seed", range(6))
def test_one_pool_for_every_layer_packs_into_the_fewest_blocks_and_keeps_every_token(seed):
    """Layer-varying budgets (a pyramid): each layer relocates in its own part of the blocks, ``pack``
    then moves pages into the other layers' free ones, and the request keeps ceil(pages / (L*H))
    blocks and its spares; every kept token is where the page table says, before and after decode."""
    gen = torch.Generator().manual_seed(seed)
    layers, num_blocks, total_blocks = 3, 6, 16
    base = [layer * total_blocks * H for layer in range(layers)]
    blocks, appended = torch.randperm(total_blocks, generator=gen).split([num_blocks, total_blocks - num_blocks])
    blocks, appended = blocks.tolist(), iter(appended.tolist())  # vLLM's next blocks: any free ones
    length = num_blocks * BS - int(torch.randint(0, BS, (1,), generator=gen))
    space = torch.full((layers * total_blocks * H * BS,), -1, dtype=torch.int64)
    label = lambda layer, head, pos: (layer * 100 + head) * 1000 + pos
    pages = RequestPages(num_layers=layers, num_heads=H, block_size=BS, blocks=blocks, layer_base=base)
    for layer in range(layers):
        for head in range(H):
            positions = torch.arange(length)
            space[pages.current_slots(layer, [positions if h == head else positions[:0] for h in range(H)])] = label(
                layer, head, positions
            )
    kept = {}
    for layer in range(layers):
        most = length if layer == 0 else length // (2 * layer)  # the bottom layer keeps far more
        keep = [
            torch.sort(
                torch.randperm(length, generator=gen)[: int(torch.randint(1, most + 1, (1,), generator=gen))]
            ).values
            for _ in range(H)
        ]
        _apply(space, pages.relocate(layer, keep))
        kept.update({(layer, head): label(layer, head, keep[head]) for head in range(H)})
    _apply(space, pages.pack())
    held = int(pages._page_counts().sum())
    keep_blocks = pages.blocks_to_keep(length)
    assert len(keep_blocks) in (-(-held // (layers * H)), -(-held // (layers * H)) + 1)
    pages.release_except(keep_blocks)
    for step in range(3 * BS):
        if length % BS == 0:
            pages.add_blocks([next(appended)])
        slots = pages.append(1)  # [layers, 1, heads]
        for layer in range(layers):
            for head in range(H):
                space[slots[layer, 0, head]] = label(layer, head, 10_000 + length)
                kept[layer, head] = torch.cat([kept[layer, head], torch.tensor([label(layer, head, 10_000 + length)])])
        length += 1
    for (layer, head), labels in kept.items():
        n = labels.numel()
        slots = pages.current_slots(layer, [torch.arange(n) if h == head else torch.arange(0) for h in range(H)])
        assert torch.equal(space[slots], labels)


def test_pooled_layers_hand_back_what_the_per_layer_pools_must_hold():
    """Layer 0 keeps 4 pages a head, layer 1 one: per layer, layer 0 sets 4 blocks; pooled, 5 pages
    a head fill 3 blocks of 2 layers x 2 heads (and a spare block while the prompt is read)."""
    counts = [4 * BS, BS]
    per_layer = RequestPages(num_layers=2, num_heads=H, block_size=BS, blocks=list(range(6)))
    pooled = RequestPages(num_layers=2, num_heads=H, block_size=BS, blocks=list(range(6)), layer_base=[0, 6 * H])
    for pages in (per_layer, pooled):
        for layer, n in enumerate(counts):
            pages.relocate(layer, [torch.arange(n)] * H)
    pooled.pack()
    assert len(per_layer.blocks_to_keep(6 * BS)) == 4
    assert len(pooled.blocks_to_keep(6 * BS)) == 3
    assert len(pooled.blocks_to_keep(None)) == 4


def test_stock_page_tables_list_the_pages_stock_slots_write():
    """Row r's head h reads, in page order, the pages vLLM's stock layout writes its tokens to."""
    block_table = torch.tensor([[3, 0, 7], [5, 2, 1]], dtype=torch.int32)
    tables = stock_page_tables(block_table, H)
    assert tables.shape == (2 * H, 3)
    positions = torch.arange(3 * BS)
    for row, blocks in enumerate(block_table):
        slots = stock_slots(blocks, H, BS, positions, torch.arange(H))
        for head in range(H):
            assert tables[row * H + head].tolist() == (slots[head, ::BS] // BS).tolist()
    assert stock_page_tables(torch.zeros(0, 0, dtype=torch.int64), H).shape == (0, 0)
