"""PoD in the real engine: with one-layer blocks it is the full cache; with the shipped grouping it frees what the
grouping says, decode equals eq. 3-4 recomputed from the captured tensors, and every block comes back."""

import json
import math

import numpy as np
import pytest
import torch

from kvpolicy.policies.pod import LayerGroups, PoD
from tests.e2e.conftest import POOL_16_BLOCKS
from tests.e2e.engine_run import MAX_TOKENS, PROMPT_LENS

BLOCK_SIZE = 128  # vLLM's CPU block size for this model
RECENT = 128  # n_r small enough that the test prompts have distant tokens (the default is 1008)
POD = ("--policy", "pod", "--recent-tokens", str(RECENT))
PAPER_DELTA = 0.5  # shares enough layers for these short prompts to free blocks (the shipped 0.65 frees none)
SHARING = (*POD, "--pod-delta", str(PAPER_DELTA), "--capture")
LAYOUT_LEN = 16 + RECENT + BLOCK_SIZE  # the first length with a page's worth of distant tokens


def layout_lengths(max_tokens: int = MAX_TOKENS) -> list[int]:
    """The length at which each request is laid out: at the end of its prompt, or in decode once it reaches
    ``LAYOUT_LEN`` (the last generated token is never fed back)."""
    return [max(n, LAYOUT_LEN) for n in PROMPT_LENS if n + max_tokens - 1 >= LAYOUT_LEN]


@pytest.fixture(scope="module")
def single_layer_groups(tmp_path_factory):
    path = tmp_path_factory.mktemp("pod") / "single.json"
    groups = LayerGroups.single_layers(30, 3)
    path.write_text(json.dumps({"blocks": groups.blocks}))
    return str(path)


def expected_released_blocks(groups: LayerGroups, lengths) -> int:
    """The blocks the layout frees, from the grouping: pages of every (layer, head), packed, plus a spare block."""
    keeps = np.array(groups.keeps_distant_keys())
    released = 0
    for n in lengths:
        start, end = PoD(recent_tokens=RECENT).distant_range(n)
        distant = end - start
        shared_pages = math.ceil((n - distant) / BLOCK_SIZE) + math.ceil(math.ceil(distant / 2) / BLOCK_SIZE)
        pages = np.where(keeps, math.ceil(n / BLOCK_SIZE), shared_pages).sum()
        blocks = math.ceil(n / BLOCK_SIZE)
        released += blocks - min(math.ceil(pages / keeps.size) + 1, blocks)
    return released


def test_pod_with_one_layer_blocks_is_the_full_cache(engine_run, single_layer_groups):
    run = engine_run(*POD, "--pod-groups", single_layer_groups)
    stock = engine_run("--stock")["requests"]
    assert run["counters"]["pod_layouts"] == len(layout_lengths())
    for ours, theirs in zip(run["requests"], stock):
        assert ours["token_ids"] == theirs["token_ids"]
        for got, want in zip(ours["logprobs"], theirs["logprobs"]):
            top = max(want, key=want.get)
            assert got[top] == pytest.approx(want[top], abs=2e-3)  # torch's attention vs vLLM's kernel, float32
    assert run["kv_cache_usage_end"] == 0.0


def test_pod_frees_the_distant_keys_of_shared_layers(engine_run):
    run = engine_run(*SHARING)
    counters = run["counters"]
    groups = PoD(delta=PAPER_DELTA).layer_groups()
    assert counters["pod_layouts"] == counters["compressed_requests"] == len(layout_lengths())
    assert counters["released_blocks"] == expected_released_blocks(groups, layout_lengths()) > 0
    assert counters["pod_distant_evaluated"] > 0
    assert run["kv_cache_usage_end"] == 0.0


def test_pod_decode_is_eq_3_and_4_on_the_engine_tensors(engine_run):
    """Recompute each shared (layer, head) of one decode step from the lowest layer's captured query and keys."""
    run = engine_run(*SHARING)
    records = torch.load(run["captured"])
    lowest = PoD(delta=PAPER_DELTA).layer_groups().lowest()
    checked = 0
    for (layer, head), call in records.items():
        source = lowest[layer][head]
        if source == layer:
            assert call["distant_logits"] is None
            continue
        low = records[source, head]
        start, end = call["distant"]
        scale = call["scale"]
        a_d = (low["query"].double() @ low["keys"][start:end].double().T) * scale
        a_p = (call["query"].double() @ call["keys"].double().T) * scale
        o_p = a_p.softmax(-1) @ call["values"].double()
        o_d = a_d.softmax(-1) @ call["distant_values"].double()
        g = a_p.exp().sum(-1, keepdim=True) / (a_p.exp().sum(-1, keepdim=True) + a_d.exp().sum(-1, keepdim=True))
        torch.testing.assert_close(call["out"].double(), g * o_p + (1 - g) * o_d, rtol=1e-4, atol=1e-5)
        assert call["keys"].shape[0] == low["keys"].shape[0] - (end - start), "no distant key in a shared layer"
        checked += 1
    assert checked > 0


@pytest.fixture(scope="module")
def paired_layer_groups(tmp_path_factory):
    """``mib_block_model``'s 8 layers in blocks of two (the first and last alone), alike for its 4 KV heads."""
    path = tmp_path_factory.mktemp("pod") / "paired.json"
    path.write_text(json.dumps({"blocks": [[[0], [1, 2], [3, 4], [5, 6], [7]]] * 4}))
    return str(path)


def test_pod_recomputes_after_preemption_and_returns_every_block(engine_run, mib_block_model, paired_layer_groups):
    """A 16-block pool and 150 output tokens each: vLLM preempts, a recomputed request is laid out again."""
    tight = ("--pod-groups", paired_layer_groups, *POOL_16_BLOCKS, "--max-tokens", "150")
    run = engine_run(*POD, *tight, model=mib_block_model)
    assert run["preemptions"] > 0
    assert run["counters"]["pod_layouts"] > len(layout_lengths(150)), "a laid-out request was laid out again"
    assert all(len(r["token_ids"]) == 150 for r in run["requests"])
    assert run["kv_cache_usage_end"] == 0.0


def test_pod_abort_in_decode_returns_every_block(engine_run):
    """The longest prompt is aborted after it was laid out (every layout happened), mid-decode."""
    run = engine_run(*POD, "--abort-after", "16")
    assert run["counters"]["pod_layouts"] == len(layout_lengths())
    assert len(run["requests"]) == len(PROMPT_LENS) - 1
    assert all(len(r["token_ids"]) == MAX_TOKENS for r in run["requests"])
    assert run["kv_cache_usage_end"] == 0.0
