"""OmniKV's host tier on plain tensors (no vLLM): an offload plan moves every page where the request
then reads it, frees whole blocks, and decode keeps host and device consistent."""

import pytest
import torch

from kvpolicy.paging import HostPagePool, OffloadedRequest
from kvpolicy.paging.page_table import write_order

L, H, BS, NUM_BLOCKS = 4, 2, 4, 12
FULL = [True, True, False, False]  # layers 0-1 attend to everything, 2-3 are sparse
BASE = [layer * NUM_BLOCKS * H for layer in range(L)]  # layer-outer buffer, as vLLM's CPU cache


def stamp(layer: int, page: int, head: int) -> float:
    return 1000 * layer + 10 * page + head


def stock_buffer(blocks: list[int], num_pages: int) -> torch.Tensor:
    """vLLM's buffer as one-head pages; page i of (layer, head) carries stamp(layer, i, head)."""
    pages = torch.full((L * NUM_BLOCKS * H, 1), -1.0)
    for layer in range(L):
        for head in range(H):
            for i in range(num_pages):
                pages[BASE[layer] + blocks[i] * H + head] = stamp(layer, i, head)
    return pages


def offloaded(length: int, blocks: list[int], staging: int = 1):
    request = OffloadedRequest(BASE, H, BS, blocks, FULL)
    host = HostPagePool(64, 1, torch.float32)
    device = stock_buffer(blocks, -(-length // BS))
    plan = request.offload(length, host, staging, max_length=40)
    plan.to_host.apply(device, host.pages)
    plan.on_device.apply(device, device)
    return request, host, device, plan


def test_offload_puts_every_page_where_the_request_reads_it_and_frees_blocks():
    blocks = [5, 1, 8, 3, 10, 0]
    request, host, device, plan = offloaded(22, blocks)  # 6 pages, the last holding 2 tokens
    for layer in range(L):
        for head in range(H):
            if FULL[layer]:
                assert device[request.full_table(layer)[head], 0].tolist() == [stamp(layer, i, head) for i in range(6)]
            else:
                assert host.pages[request.host_pages[layer][head], 0].tolist() == [
                    stamp(layer, i, head) for i in range(5)
                ]
                assert device[request.pages[layer][head][0], 0].item() == stamp(layer, 5, head)
    # Per head 2 full layers x 6 pages + 2 tails + 2 x 1 staging page: 16 pages, 4 blocks of 8, and a spare.
    assert plan.keep_blocks == set(range(5))
    kept = {BASE[layer] + b * H + h for layer in range(L) for b in blocks[:5] for h in range(H)}
    used = [p for tables in (request.pages, request.staging) for layer in tables for head in layer for p in head]
    assert len(used) == len(set(used)) and set(used) <= kept
    assert request.release_except(plan.keep_blocks) == 1 and request.live_blocks() == 5


def test_with_prefix_caching_the_offload_writes_only_its_own_blocks():
    """Block 0 is read by another request, 2-3 are in the prefix cache: the full layers' pages of
    block 0 move, the other positions' stay where they are, and nothing is written to block 0."""
    blocks = [5, 1, 8, 3, 10, 0]
    order = write_order(6, shared=[0], cached=[2, 3])
    request = OffloadedRequest(BASE, H, BS, blocks, FULL, order)
    assert request.blocks_needed(22, 1) == 5 == len(order)
    host = HostPagePool(64, 1, torch.float32)
    device = stock_buffer(blocks, 6)
    before = device.clone()
    plan = request.offload(22, host, 1, max_length=40)
    shared = {BASE[layer] + blocks[0] * H + h for layer in range(L) for h in range(H)}
    assert not shared & set(plan.on_device.dst.tolist())
    plan.to_host.apply(device, host.pages)
    plan.on_device.apply(device, device)
    assert torch.equal(device[sorted(shared)], before[sorted(shared)])
    for layer in (0, 1):
        for head in range(H):
            assert device[request.full_table(layer)[head], 0].tolist() == [stamp(layer, i, head) for i in range(6)]
    assert plan.keep_blocks == {1, 2, 3, 4, 5}
    assert request.release_except(plan.keep_blocks) == 1


def test_an_offload_without_room_in_its_own_blocks_is_refused():
    request = OffloadedRequest(BASE, H, BS, [5, 1, 8, 3, 10, 0], FULL, write_order(6, shared=[0, 1, 2]))
    with pytest.raises(ValueError, match="needs more blocks than the 3 it may write"):
        request.offload(22, HostPagePool(64, 1, torch.float32), 1, max_length=40)


def test_decode_flushes_full_tails_and_sparse_calls_read_the_selection():
    blocks = [5, 1, 8, 3]
    request, host, device, plan = offloaded(16, blocks, staging=2)  # 4 full pages: the tail is full
    request.release_except(plan.keep_blocks)
    request.add_blocks([7])  # vLLM's block for tokens 16-19
    slots, flushes = request.append(host)
    assert request.length == 17
    for layer in (2, 3):
        (tail,) = request.pages[layer][0]
        assert flushes[layer].src.tolist() == [tail, request.pages[layer][1][0]]
        assert slots[layer, 0].item() == tail * BS  # the new token starts the emptied tail page
        host.pages[flushes[layer].dst] = device[flushes[layer].src]
        assert host.pages[request.host_pages[layer][0], 0].tolist() == [stamp(layer, i, 0) for i in range(4)]
    for layer in (0, 1):
        assert flushes[layer].src.numel() == 0
        assert slots[layer, 1].item() == request.full_table(layer)[1][4] * BS  # a fifth page, offset 0
    call = request.sparse_call(2, [0, 2, 4])
    assert call.loads.src.tolist() == [request.host_pages[2][h][i] for i in (0, 2) for h in range(H)]
    assert call.seq_len == 2 * BS + 1
    call.loads.apply(host.pages, device)
    for h in range(H):
        assert device[call.table[h], 0].tolist()[:2] == [stamp(2, 0, h), stamp(2, 2, h)]
        assert call.table[h][-1] == request.pages[2][h][0]
    again = request.sparse_call(2, [2, 3, 4])  # page 2 is still staged: only page 3 is copied
    assert again.loads.src.tolist() == [request.host_pages[2][h][3] for h in range(H)]
    again.loads.apply(host.pages, device)
    for h in range(H):
        assert device[again.table[h][:2], 0].tolist() == [stamp(2, 2, h), stamp(2, 3, h)]


def test_a_full_host_pool_refuses_the_request_and_changes_nothing():
    request = OffloadedRequest(BASE, H, BS, [5, 1, 8], FULL)
    host = HostPagePool(10, 1, torch.float32)
    with pytest.raises(MemoryError):
        request.offload(12, host, 1, max_length=40)  # 2 sparse layers x 2 heads x 9 pages up to 40 tokens
    assert host.num_available == 10 and host.reserved == 0


def test_released_host_pages_and_reserve_return_to_the_pool():
    request, host, _, _ = offloaded(12, [5, 1, 8])
    assert host.num_available == 64 - 2 * H * 9
    host.release(request.host_page_ids(), request.host_reserved)
    assert host.num_available == 64 and host.reserved == 0
