"""FlashAttention 3 behind ``TritonOps.attend``: which calls take it, and the arguments they hand it, on CPU.

FlashAttention 3 does not import without a Hopper GPU, so the ops get a stand-in with its signature that
records its arguments and computes what the kernel computes from them (``flash_semantics``: pages through the
block table, ``seqused_k`` keys, causal from the bottom right). Checked: the decision (dtype, compute
capability, availability); per-head decode rows, a prompt chunk in vLLM's layout and the fixed-shape decode
step all go there in bf16 and give kvpolicy's loop reference's output; fp32 stays on the Triton kernel;
the fixed-shape call's indices are the persistent buffers themselves, the same tensors at every step (what a
CUDA graph replays), sized for the longest sequence the model allows, and its padded sequences read nothing.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from kvpolicy.vllm.worker.modes.base import StepShape
from kvpolicy.vllm.worker.modes.fixed_decode import FixedDecode
from kvpolicy.vllm.worker.ops.flash_varlen import FIXED_SPLITS, choose_flash, flash_pages
from kvpolicy.vllm.worker.ops.triton import TritonOps, plan_virtual_sequences
from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows
from kvpolicy_triton import PageGeometry, paged_attention_reference
from tests.unit.test_flash_varlen import flash_semantics

KV_HEADS, GROUP, HEAD_SIZE, BLOCK_SIZE, BLOCKS, LAYERS = 2, 3, 16, 4, 16, 2
Q_HEADS, SCALE, MAX_MODEL_LEN = KV_HEADS * GROUP, 1 / math.sqrt(HEAD_SIZE), 24
BF16 = dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("capability", "unavailable", "flash"),
    [
        (None, None, False),
        ((8, 0), None, False),
        ((8, 9), None, False),
        ((10, 0), None, False),
        ((9, 0), "FA3 is unavailable due to: no module", False),
        ((9, 0), None, True),
    ],
)
def test_flash_attention_serves_compute_capability_9_when_the_wheel_loads_it(capability, unavailable, flash):
    reason = choose_flash(capability, unavailable)
    assert (reason is None) == flash
    if unavailable is not None and capability[0] == 9:
        assert reason == unavailable


class StandIn:
    """``flash_attn_varlen_func`` on CPU: records each call's arguments, writes ``flash_semantics`` into ``out``."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, **kwargs):
        assert q.dim() == 3 and q.shape[1:] == (GROUP, HEAD_SIZE) and k.shape[2] == 1, "one KV head, its G query heads"
        for name in ("seqused_k", "block_table"):
            assert kwargs[name].dtype == cu_seqlens_q.dtype == torch.int32, name
        assert kwargs["causal"] and kwargs["softmax_scale"] == SCALE
        lengths = kwargs["seqused_k"]
        assert int(lengths.max()) <= max_seqlen_k
        assert int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
        self.calls.append(dict(q=q, k=k, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, **kwargs))  # fmt: skip
        result = flash_semantics(
            q.float(), k.float(), v.float(), cu_seqlens_q, lengths, kwargs["block_table"], SCALE
        ).to(q.dtype)  # 0 where a sequence has no key, as FlashAttention writes
        out = kwargs["out"]
        if out is None:
            return result
        out.copy_(result)
        return out


@pytest.fixture
def ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return TritonOps(flash=StandIn())


def layer_of():
    impl = SimpleNamespace(num_kv_heads=KV_HEADS, num_queries_per_kv=GROUP, head_size=HEAD_SIZE, scale=SCALE)
    return SimpleNamespace(impl=impl, layer_name="model.layers.0.self_attn.attn")


def cache_of(dtype, physical="HND") -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if physical == "HND":
        return torch.randn(BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=generator).to(dtype)
    return torch.randn(BLOCKS, BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE, generator=generator).to(dtype).transpose(1, 2)


def reference(query, cache, token_of, head_of, starts, lengths, table) -> torch.Tensor:
    want = torch.zeros(query.shape, dtype=torch.float32)
    paged_attention_reference(
        query.float(), want, cache.float(), PageGeometry.head_major(cache), token_of, head_of, starts, lengths, table,
        SCALE, KV_HEADS,
    )  # fmt: skip
    return want


def one_head_decode(requests: int):
    """A decode step whose every row goes per head: each (request, head) on its own pages and length."""
    sequences = requests * KV_HEADS
    rows = HeadRows(torch.arange(sequences) // KV_HEADS, torch.arange(sequences) % KV_HEADS, whole_batch=True)
    starts = torch.arange(sequences + 1, dtype=torch.int32)
    lengths = torch.tensor([5, 11, 1, 8, 14, 3][:sequences], dtype=torch.int32)
    table = torch.randperm(BLOCKS * KV_HEADS, generator=torch.Generator().manual_seed(3))[: sequences * 4]
    table = table.view(sequences, 4).int()
    plan = plan_virtual_sequences(starts, lengths, table, 1, GROUP)
    return AttentionBatch(torch.arange(requests), starts, lengths, table, 1, plan), rows


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_per_head_decode_rows_in_bf16_go_to_flash_attention(ops, physical):
    cache = cache_of(torch.bfloat16, physical)
    batch, rows = one_head_decode(3)
    query = torch.randn(3, Q_HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = torch.full_like(query, 7.0)
    ops.attend(layer_of(), query, out, cache, batch, rows)
    (call,) = ops.flash.calls
    assert call["out"] is not None and call["out"].data_ptr() == out.data_ptr(), "written in place, no scatter"
    want = reference(query, cache, rows.token_of, rows.head_of, batch.query_start_loc, batch.seq_lens,
                     batch.block_table)  # fmt: skip
    torch.testing.assert_close(out.float(), want, **BF16)
    same = physical == "HND"
    assert same == torch.equal(call["block_table"], batch.block_table), "HND: kvpolicy's page ids are FlashAttention's"


def test_a_prompt_chunk_in_vllms_layout_among_other_tokens_goes_to_flash_attention(ops):
    cache = cache_of(torch.bfloat16, "NHD")
    query = torch.randn(9, Q_HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(2)).bfloat16()
    token_idx = torch.tensor([1, 2, 3, 4, 5, 7])  # tokens 0, 6 and 8 are other calls'
    starts = torch.tensor([0, 5, 6], dtype=torch.int32)
    lengths = torch.tensor([11, 14], dtype=torch.int32)
    blocks = torch.tensor([[5, 0, 9, 0], [3, 8, 1, 11]], dtype=torch.int32)
    plan = plan_virtual_sequences(starts, lengths, blocks, KV_HEADS, GROUP)
    out = torch.full_like(query, 7.0)
    ops.attend(layer_of(), query, out, cache, AttentionBatch(token_idx, starts, lengths, blocks, KV_HEADS, plan))
    (call,) = ops.flash.calls
    assert call["max_seqlen_q"] == 5 and call["max_seqlen_k"] == 14 and call["num_splits"] == 0
    want = reference(query, cache, token_idx[plan.local_token], plan.head_of, plan.query_start_loc, plan.seq_lens,
                     plan.page_table)  # fmt: skip
    torch.testing.assert_close(out[token_idx].float(), want[token_idx], **BF16)
    assert (out[[0, 6, 8]] == 7.0).all(), "the other calls' tokens are not written"


def test_fp32_stays_on_the_triton_kernel(ops, monkeypatch):
    # This cache is head-major row by row, as on a GPU, not in a CPU ISA's packing.
    monkeypatch.setattr(
        "kvpolicy.vllm.worker.ops.triton.cache_geometry", lambda layer, cache: PageGeometry.head_major(cache)
    )
    cache = cache_of(torch.float32)
    batch, rows = one_head_decode(2)
    query = torch.randn(2, Q_HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(4))
    out = torch.zeros_like(query)
    ops.attend(layer_of(), query, out, cache, batch, rows)
    assert ops.flash.calls == []
    want = reference(query, cache, rows.token_of, rows.head_of, batch.query_start_loc, batch.seq_lens,
                     batch.block_table)  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_the_fixed_shape_step_hands_flash_attention_its_buffers_and_padded_rows_read_nothing(ops):
    """Two steps at one padded size, different lengths and pages: the same tensors each time (views of the
    buffers a graph captured), the model's longest sequence and a fixed split bound; padding is 0 keys long."""
    shape = StepShape(LAYERS, KV_HEADS, GROUP, BLOCK_SIZE, MAX_MODEL_LEN, ops.plan)
    fixed = FixedDecode(SimpleNamespace(worker=None), ops, shape, 8, HEAD_SIZE, "cpu")
    cache = cache_of(torch.bfloat16)
    layer = layer_of()
    rows, real = 4, 3  # a batch of 3 requests padded to 4 rows
    calls = fixed.calls(rows)
    n, generator = rows * KV_HEADS, torch.Generator().manual_seed(5)
    seen = []
    for step in range(2):
        lengths = torch.randint(1, MAX_MODEL_LEN + 1, (LAYERS, real * KV_HEADS), generator=generator).int()
        fixed.seq_lens[:, : real * KV_HEADS] = lengths
        fixed.seq_lens[:, real * KV_HEADS : n] = 0
        fixed.tables[:, :n] = torch.randint(0, BLOCKS * KV_HEADS, fixed.tables[:, :n].shape, generator=generator)
        fixed.tables[:, real * KV_HEADS : n] = -1  # stale or garbage in padding: never read
        query = torch.randn(rows, Q_HEADS, HEAD_SIZE, generator=generator).bfloat16()
        for index in range(LAYERS):
            out = torch.full_like(query, 7.0)
            ops.attend(layer, query, out, cache, calls.layers[index], calls.rows)
            call = ops.flash.calls[-1]
            assert call["cu_seqlens_q"] is calls.layers[index].query_start_loc
            assert call["seqused_k"] is calls.layers[index].seq_lens
            assert call["block_table"] is calls.layers[index].block_table, "HND: the buffer itself, no conversion"
            assert call["seqused_k"].data_ptr() == fixed.seq_lens[index].data_ptr()
            assert call["block_table"].data_ptr() == fixed.tables[index].data_ptr()
            assert call["max_seqlen_q"] == 1 and call["max_seqlen_k"] == MAX_MODEL_LEN
            assert call["num_splits"] == FIXED_SPLITS and call["out"].data_ptr() == out.data_ptr()
            seen.append(tuple(call[k].data_ptr() for k in ("cu_seqlens_q", "seqused_k", "block_table")))
            real_rows = torch.arange(real * KV_HEADS)
            want = reference(query, cache, real_rows // KV_HEADS, real_rows % KV_HEADS,
                             fixed.query_start_loc[: real * KV_HEADS + 1], fixed.seq_lens[index, : real * KV_HEADS],
                             fixed.tables[index, : real * KV_HEADS])  # fmt: skip
            torch.testing.assert_close(out[:real].float(), want[:real], **BF16)
            assert (out[real:] == 0).all(), "the padded row's sequences have no key"
    assert seen[:LAYERS] == seen[LAYERS:], "each layer's call reads the same buffers at every step"


def test_flash_pages_are_made_once_per_cache(ops):
    cache = cache_of(torch.bfloat16)
    first = ops.pages_for_flash(cache)
    assert ops.pages_for_flash(cache) is first
    assert first.same_ids and not flash_pages(cache_of(torch.bfloat16, "NHD")).same_ids
