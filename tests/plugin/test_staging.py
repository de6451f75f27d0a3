"""A step's index tensors reach the device in one copy, and every view the ops ask for reads that copy.

On this CPU machine the "device" is the CPU, so the staged buffer is a real
second copy: a view of it must equal the host tensor, and must not share its
memory.
"""

import numpy as np
import pytest
import torch

from kvpolicy.paging import PageStore, RequestPages
from kvpolicy.vllm.worker.ops import staging
from kvpolicy.vllm.worker.ops.staging import StagedStep, TableMirror
from kvpolicy.vllm.worker.ops.triton import TritonOps, plan_virtual_sequences
from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows, PerHeadBatch, RelocatingStep, step_tensors


def per_head_step(layers: int = 4, rows: int = 3, heads: int = 2, width: int = 5) -> RelocatingStep:
    """A decode step's records as the builder makes them: per-layer slices of one lengths array and one table."""
    rng = np.random.default_rng(0)
    lengths = torch.from_numpy(rng.integers(1, width * 16, size=(layers, rows * heads)).astype(np.int32))
    store = PageStore(layers, heads, 16, pools_layers=False, rows=rows)
    store.tables = rng.integers(0, 1000, size=(layers, rows * heads, width)).astype(np.int32)
    tables = torch.from_numpy(store.tables)
    token_idx = torch.arange(rows)
    qsl = torch.arange(rows * heads + 1, dtype=torch.int32)
    calls = [
        AttentionBatch(
            token_idx,
            qsl,
            lengths[layer],
            tables[layer],
            1,
            plan_virtual_sequences(qsl, lengths[layer], tables[layer], 1, 4),
        )
        for layer in range(layers)
    ]
    head_rows = HeadRows(token_idx.repeat_interleave(heads), torch.arange(heads).repeat(rows), True)
    slots = torch.from_numpy(rng.integers(0, 10**6, size=(layers, rows * heads)))
    stock_table = torch.tensor([[7, 8, 9]], dtype=torch.int32)
    stock = AttentionBatch(
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        stock_table[:0],
        2,
        plan_virtual_sequences(torch.zeros(1, dtype=torch.int32), torch.zeros(0), stock_table[:0], 2, 4),
    )
    return RelocatingStep(
        stock=stock,
        per_head=PerHeadBatch(
            token_idx,
            head_rows,
            calls,
            slots,
            ["a", "b", "c"],
            store,
            seq_lens=lengths,
            tables=tables[:, : rows * heads],
        ),
    )


def test_every_view_of_a_staged_storage_reads_the_one_copy():
    step = per_head_step()
    copies = []
    real = staging.copy_to
    staging.copy_to = lambda device, tensors: copies.append(len(tensors)) or real(device, tensors)
    try:
        staged = StagedStep(step_tensors(step), torch.device("cpu"))
        per_head = step.per_head
        asked = [
            per_head.slots[2],
            per_head.layers[3].block_table,
            per_head.layers[1].seq_lens,
            per_head.rows.head_of,
            per_head.token_idx,
            per_head.layers[0].block_table[:, 1:3],
        ]
        on_device = staged.to_device(asked)
    finally:
        staging.copy_to = real
    assert copies == [1], "one copy for the whole step, none per view"
    for host, device in zip(asked, on_device):
        assert torch.equal(host, device)
        assert device.untyped_storage().data_ptr() == staged.buffer.untyped_storage().data_ptr()


def test_a_tensor_made_after_the_step_is_copied_on_its_own():
    staged = StagedStep(step_tensors(per_head_step()), torch.device("cpu"))
    later = torch.arange(5)
    assert staged.on(later) is None
    assert staged.to_device([later])[0] is later  # already where the "device" is


def test_only_the_bytes_a_step_views_are_sent():
    """vLLM's block table is one large persistent tensor; a step's rows of it are a small view."""
    persistent = torch.zeros(1024, 512, dtype=torch.int32)
    rows = persistent[:2, :8]
    staged = StagedStep([rows], torch.device("cpu"))
    assert staged.buffer.numel() < 512 * 4 * 2 + staging.ALIGN
    assert torch.equal(staged.to_device([rows])[0], rows)
    assert staged.on(persistent[:3]) is None, "a wider view of the storage was not staged"


@pytest.mark.parametrize("staged_step", [True, False])
def test_the_triton_ops_read_the_staged_copy_when_there_is_one(staged_step):
    step = per_head_step()
    ops = TritonOps()
    ops.staged = StagedStep(step_tensors(step), torch.device("cpu")) if staged_step else None
    (slots,) = ops._on(torch.device("cpu"), step.per_head.slots[0])
    assert torch.equal(slots, step.per_head.slots[0])
    shares = slots.untyped_storage().data_ptr() == step.per_head.slots.untyped_storage().data_ptr()
    assert shares != staged_step


def test_the_device_tables_follow_the_store_by_its_changes():
    """The page tables reach the device whole once; later steps carry the rows that moved or were rewritten
    and the entries appends wrote, and the device's tables equal the host's after every step."""
    layers, heads, block_size = 3, 2, 4
    store = PageStore(layers, heads, block_size, pools_layers=False)
    requests = [RequestPages(layers, heads, block_size, list(range(8 * i, 8 * i + 8)), store=store) for i in range(6)]
    rng = np.random.default_rng(0)
    for pages in requests:
        for layer in range(layers):
            pages.relocate(layer, [torch.arange(int(n)) for n in rng.integers(1, 20, size=heads)])
    mirror, device = TableMirror(), torch.device("cpu")
    sent = []
    real = staging.copy_to
    staging.copy_to = lambda device, tensors: sent.append(sum(t.nbytes for t in tensors)) or real(device, tensors)
    try:
        for step in range(12):
            batch = [requests[i] for i in rng.permutation(len(requests))[: rng.integers(1, len(requests) + 1)]]
            if step == 5:
                batch[0].relocate(1, [torch.arange(2)] * heads)  # a rewrite between steps
            store.arrange(batch)
            store.append(np.arange(len(batch)), np.ones(len(batch), dtype=np.int64))
            staged = mirror.stage(store, [], device)
            assert torch.equal(mirror.tables, torch.from_numpy(store.tables)), step
            view = torch.from_numpy(store.tables)[1, : len(batch) * heads]
            assert torch.equal(staged.on(view), view)
            assert staged.on(view).untyped_storage().data_ptr() == mirror.tables.untyped_storage().data_ptr()
    finally:
        staging.copy_to = real
    assert len(sent) == 12, "one copy per step"
    assert sent[0] == store.tables.nbytes, "the first step sends the tables whole"
    assert max(sent[1:]) < store.tables.nbytes, "every later step sends less: only what changed"
