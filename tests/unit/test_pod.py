"""PoD: the similarity and grouping of §2.1, eq. 3-4 (``kvpolicy_triton.shared_attention_reference``, which the
kernels are tested against) against a reference written from the paper, and the shared layout."""

import json
import math

import numpy as np
import pytest
import torch

from kvpolicy.config import KVPolicyConfig
from kvpolicy.paging import DecodeTables, DistantLogitRows, SharedPages
from kvpolicy.paging.page_table import page_slots, write_order
from kvpolicy.policies.pod import (
    DEFAULT_GROUPS,
    LayerGroups,
    PoD,
    group_layers,
    js_similarity,
)
from kvpolicy_triton import shared_attention_reference


def reference_pod(q_own, k_own, v_own, q_low, k_low, sinks, recent, scale):
    """Eq. 3-4 for one query head, term by term: ``o = g * o_P + (1 - g) * o_D``."""
    n = k_own.shape[0]
    proximal = list(range(sinks)) + list(range(n - recent, n))
    distant = list(range(sinks, n - recent))
    a_p = torch.stack([q_own @ k_own[j] for j in proximal]).double() * scale
    o_p = sum(w * v_own[j].double() for w, j in zip(a_p.softmax(0), proximal))
    a_d = torch.stack([q_low @ k_low[j] for j in distant]).double() * scale
    o_d = sum(w * v_own[j].double() for w, j in zip(a_d.softmax(0), distant))
    g = a_p.exp().sum() / (a_p.exp().sum() + a_d.exp().sum())
    return g * o_p + (1 - g) * o_d


def test_similarity_is_one_minus_js_divergence():
    p = torch.tensor([0.5, 0.5, 0.0])
    assert js_similarity(p, p).item() == pytest.approx(1.0)
    assert js_similarity(p, torch.tensor([0.0, 0.0, 1.0])).item() == pytest.approx(0.0)
    q = torch.tensor([0.2, 0.3, 0.5])
    assert js_similarity(p, q).item() == pytest.approx(js_similarity(q, p).item())
    m = (p + q) / 2
    js = 0.5 * sum(a * math.log2(a / b) for a, b in zip(p.tolist(), m.tolist()) if a) + 0.5 * sum(
        a * math.log2(a / b) for a, b in zip(q.tolist(), m.tolist()) if a
    )
    assert js_similarity(p, q).item() == pytest.approx(1 - js)


def test_algorithm_1_joins_a_layer_only_when_it_is_similar_to_every_layer_of_the_block():
    sim = torch.eye(5)
    sim[1, 0] = sim[0, 1] = 0.9
    sim[2, 1] = sim[1, 2] = 0.9  # similar to layer 1 but not to layer 0: a new block
    sim[3, 2] = sim[2, 3] = 0.6
    sim[4, 3] = sim[3, 4] = 0.4
    assert group_layers(sim[None].expand(2, 5, 5), 0.5) == [[[0, 1], [2, 3], [4]]] * 2
    groups = LayerGroups.of(group_layers(sim[None], 0.5))
    assert groups.lowest() == [[0], [0], [2], [2], [4]]
    assert groups.shared_fraction() == pytest.approx(2 / 5)


def test_shared_attention_is_eq_3_and_4():
    torch.manual_seed(0)
    group, n, dim, sinks, recent = 3, 40, 16, 4, 10
    q_own, q_low = torch.randn(group, dim), torch.randn(group, dim)
    k_own, k_low, v_own = torch.randn(n, dim), torch.randn(n, dim), torch.randn(n, dim)
    scale = dim**-0.5
    proximal = torch.cat([torch.arange(sinks), torch.arange(n - recent, n)])
    distant = torch.arange(sinks, n - recent)
    distant_logits = (q_low @ k_low[distant].T) * scale
    out, skipped = shared_attention_reference(
        q_own, k_own[proximal], v_own[proximal], distant_logits, v_own[distant], scale
    )
    expected = torch.stack(
        [reference_pod(q_own[g], k_own, v_own, q_low[g], k_low, sinks, recent, scale) for g in range(group)]
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    assert not skipped.any()


def test_a_lowest_layer_sharing_with_itself_is_full_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 8), torch.randn(20, 8), torch.randn(20, 8)
    full = ((q @ k.T) * 0.3).softmax(-1) @ v
    own, _ = shared_attention_reference(q, k, v, None, None, 0.3)
    split, _ = shared_attention_reference(q, k[:5], v[:5], (q @ k[5:].T) * 0.3, v[5:], 0.3)
    torch.testing.assert_close(own, full)
    torch.testing.assert_close(split, full)


def test_tau_skips_the_distant_part_where_the_proximal_gate_reaches_it():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 8), torch.randn(6, 8), torch.randn(6, 8)
    distant_logits = torch.tensor([[-30.0, -30.0], [5.0, 5.0]])
    own = q @ k.T
    gate = own.exp().sum(-1) / (own.exp().sum(-1) + distant_logits.exp().sum(-1))  # eq. 4's g, from the paper
    assert gate[0] > 0.99 > gate[1]
    out, skipped = shared_attention_reference(q, k, v, distant_logits, torch.randn(2, 8), 1.0, tau=0.99)
    assert skipped.tolist() == [True, False]
    torch.testing.assert_close(out[0], (q[0] @ k.T).softmax(-1) @ v)


def test_the_shipped_grouping_fits_the_default_model_and_saves_what_it_says():
    groups = PoD().layer_groups()
    assert (groups.num_layers, groups.num_heads) == (30, 3)
    assert PoD().saved_fraction(groups, 8192) == pytest.approx(groups.shared_fraction() * (8192 - 1024) / (2 * 8192))
    assert PoD().saved_fraction(groups, 1000) == 0.0
    assert DEFAULT_GROUPS.is_file()


def test_config_gives_pod_its_own_defaults_and_checks_its_options():
    pod = KVPolicyConfig(policy="pod").make_policy()
    assert (pod.sink_tokens, pod.recent_tokens, pod.tau) == (16, 1008, None)
    assert KVPolicyConfig(policy="streaming", budget=64).make_policy().sink_tokens == 4
    assert KVPolicyConfig(policy="pod", sink_tokens=8, pod_tau=0.7).make_policy().tau == 0.7
    with pytest.raises(ValueError, match="apply to --kv-policy pod"):
        KVPolicyConfig(policy="snapkv", budget=64, pod_tau=0.7)
    with pytest.raises(ValueError, match="calibrate_pod"):
        KVPolicyConfig(policy="pod", pod_groups="/nonexistent.json")
    with pytest.raises(ValueError, match=r"--kv-pod-delta must be in \[0, 1\]"):
        KVPolicyConfig(policy="pod", pod_delta=1.5)


def test_pod_delta_regroups_the_similarity_the_grouping_was_made_from(tmp_path):
    shipped = LayerGroups.load(DEFAULT_GROUPS)
    assert KVPolicyConfig(policy="pod", pod_delta=0.65).make_policy().layer_groups() == shipped  # its own delta
    paper = KVPolicyConfig(policy="pod", pod_delta=0.5).make_policy().layer_groups()
    assert paper.shared_fraction() > shipped.shared_fraction()
    assert LayerGroups.load(DEFAULT_GROUPS, 1.0) == LayerGroups.single_layers(30, 3)
    blocks_only = tmp_path / "blocks.json"
    blocks_only.write_text(json.dumps({"blocks": shipped.blocks}))
    with pytest.raises(ValueError, match="no similarity to regroup at delta 0.5; make it with"):
        LayerGroups.load(blocks_only, 0.5)


def _apply(plan, buffer):
    """The layout's moves on a flat buffer of one-head slots [slots, 2 (K/V), 1], read all, then write."""
    k, v = buffer[plan.tokens.src, 0].clone(), buffer[plan.tokens.src, 1].clone()
    even, odd = buffer[plan.values.even, 1].clone(), buffer[plan.values.odd, 1].clone()
    buffer[plan.tokens.dst, 0], buffer[plan.tokens.dst, 1] = k, v
    buffer[plan.values.dst, 0], buffer[plan.values.dst, 1] = even, odd


LAYERS, HEADS, BS, LENGTH = 3, 2, 4, 64
KEEPS = np.array([[True, True], [False, True], [False, False]])
BASE = [0, 16 * HEADS, 32 * HEADS]


def _stock_buffer(blocks):
    """16 blocks of 4 tokens; token i of (layer, head) in vLLM's layout holds K = 1000*layer + 100*head + i, V = -(that)."""
    buffer = torch.zeros(3 * 16 * HEADS * BS, 2, 1)
    for layer in range(LAYERS):
        for h in range(HEADS):
            for i in range(LENGTH):
                slot = (BASE[layer] + blocks[i // BS] * HEADS + h) * BS + i % BS
                buffer[slot, 0] = 1000 * layer + 100 * h + i
                buffer[slot, 1] = -(1000 * layer + 100 * h + i)
    return buffer


def _assert_laid_out(pages, buffer):
    for layer in range(LAYERS):
        for h, slots in enumerate(pages.main_slots(layer)):
            positions = list(range(LENGTH)) if KEEPS[layer, h] else [*range(2), *range(56, 64)]
            assert buffer[slots, 0, 0].tolist() == [1000 * layer + 100 * h + i for i in positions]
            assert buffer[slots, 1, 0].tolist() == [-(1000 * layer + 100 * h + i) for i in positions]
            if not KEEPS[layer, h]:
                pairs = buffer[pages.value_slots(layer, h), :, 0]
                assert pairs.flatten().tolist() == [-(1000 * layer + 100 * h + i) for i in range(2, 56)]


def test_shared_layout_keeps_distant_keys_only_in_lowest_layers_and_frees_blocks():
    blocks = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()
    pages = SharedPages(BASE, HEADS, BS, blocks, KEEPS)
    buffer = _stock_buffer(blocks)
    _apply(pages.layout(LENGTH, (2, 56)), buffer)  # 2 sinks, 54 distant, 8 recent
    _assert_laid_out(pages, buffer)
    # 3 (layer, head) pairs keep 64 tokens (16 pages), 3 keep 10 (3 pages) and 27 value pairs (7 pages):
    # 78 pages, 6 to a block, plus a spare block.
    assert pages.blocks_to_keep() == set(range(78 // 6 + 1))
    assert pages.kept_tokens() == 3 * 64 + 3 * 10 + 3 * 27
    assert pages.release_except(pages.blocks_to_keep()) == 2
    slots = pages.append()
    assert slots.shape == (LAYERS, HEADS)
    assert len(set(slots.flatten().tolist())) == LAYERS * HEADS
    assert pages.lengths.tolist() == [[65, 65], [11, 65], [11, 11]]


def test_shared_layout_never_writes_blocks_other_requests_read():
    """With prefix caching: blocks 0-1 are read by another request, 2-5 are in the prefix cache."""
    blocks = torch.randperm(16, generator=torch.Generator().manual_seed(1)).tolist()
    order = write_order(16, shared=[0, 1], cached=[2, 3, 4, 5])
    pages = SharedPages(BASE, HEADS, BS, blocks, KEEPS, order)
    buffer = _stock_buffer(blocks)
    before = buffer.clone()
    assert pages.blocks_needed(LENGTH, (2, 56)) == 14 == len(order)
    plan = pages.layout(LENGTH, (2, 56))
    _apply(plan, buffer)
    _assert_laid_out(pages, buffer)
    shared_slots = {
        (BASE[layer] + blocks[b] * HEADS + h) * BS + t
        for layer in range(LAYERS)
        for b in (0, 1)
        for h in range(HEADS)
        for t in range(BS)
    }
    assert not shared_slots & (set(plan.tokens.dst.tolist()) | set(plan.values.dst.tolist()))
    assert torch.equal(buffer[sorted(shared_slots)], before[sorted(shared_slots)])
    # Its own blocks first, then the cached ones from the last back; the shared ones are handed back.
    assert pages.blocks_to_keep() == set(order)
    assert pages.release_except(pages.blocks_to_keep()) == 2


def test_decode_tables_stack_each_requests_pages_and_logit_rows():
    """Two laid-out requests after a decode append: one sequence per (request, head), one plane per layer."""
    rows = DistantLogitRows.of(np.array([[0, 0], [0, 1], [0, 1]]))  # KEEPS' blocks
    assert rows.per_row == 2 and rows.write.tolist() == [[0, -1], [-1, 1], [-1, -1]]
    assert rows.read.tolist() == [[-1, -1], [0, -1], [0, 1]]
    requests = []
    for seed, distant in ((0, (2, 56)), (1, (3, 40))):
        pages = SharedPages(
            BASE, HEADS, BS, torch.randperm(16, generator=torch.Generator().manual_seed(seed)).tolist(), KEEPS
        )
        pages.layout(LENGTH, distant)
        pages.append()  # a full page in every lowest (layer, head): a new page there
        requests.append(pages)
    all_tables = DecodeTables.of(requests, rows)
    tables = all_tables.stacked
    for r, pages in enumerate(requests):
        for layer in range(LAYERS):
            for h in range(HEADS):
                s = r * HEADS + h
                n = int(tables.seq_lens[layer, s])
                assert n == pages.lengths[layer, h]
                assert torch.equal(page_slots(tables.page_table[layer, s].tolist(), n, BS), pages.main_slots(layer)[h])
                if not KEEPS[layer, h]:
                    assert torch.equal(
                        page_slots(tables.value_table[layer, s].tolist(), -(-pages.num_distant // 2), BS),
                        pages.value_slots(layer, h),
                    )
        assert tables.distant_start[r * HEADS : (r + 1) * HEADS].tolist() == [pages.distant[0]] * HEADS
        assert tables.distant_count[r * HEADS : (r + 1) * HEADS].tolist() == [pages.num_distant] * HEADS
    assert tables.write_to.tolist() == [[0, -1, 2, -1], [-1, 1, -1, 3], [-1, -1, -1, -1]]
    assert tables.read_from.tolist() == [[-1, -1, -1, -1], [0, -1, 2, -1], [0, 1, 2, 3]]
    assert (all_tables.logit_rows, all_tables.max_distant) == (4, 54)
    assert torch.equal(all_tables.layer(1).page_table, tables.page_table[1])
