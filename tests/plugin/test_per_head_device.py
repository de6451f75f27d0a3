"""The per-head path scores where the cache is: nothing it reads of the cache is copied to the host.

The cache here lies on the ``meta`` device, which stands for a GPU whose data never reaches the host: a ``.cpu()``,
``.item()`` or ``.tolist()`` of anything read from it (K/V, window queries, a new token's weights, carried scores)
raises. Fake ops hand out meta tensors and record the moves; the page table stays on the host. A prompt is relocated in
every layer, decode steps add their weights to the carried scores, and an eviction pass repacks: every move must take
its sources from the cache's device and its destinations from the page table. The policies that read per-head counts or
layer budgets back (Ada-KV's allocation, D2O's layer budgets: one read a prompt, counted in test_host_reads.py) are
left out; tests/unit/test_policy_devices.py covers their scoring.
"""

from types import SimpleNamespace

import pytest
import torch

from kvpolicy.config import KVPolicyConfig
from kvpolicy.paging import RequestPages
from kvpolicy.vllm.worker.modes import make_mode, make_path
from kvpolicy.vllm.worker.ops import KVOps
from kvpolicy.vllm.worker.state import WorkerState
from kvpolicy.vllm.worker.step import AttentionBatch, HeadRows, PerHeadBatch, RelocatingStep, Relocation

LAYERS, H, G, D, BS = 2, 3, 3, 16, 16
PROMPT, BUDGET, DECODE = 100, 40, 20
DEVICE = torch.device("meta")
REQ = "req-0"


class MetaOps(KVOps):
    """Ops over a cache on the meta device: reads give meta tensors, moves are recorded."""

    def __init__(self):
        self.moves: list[tuple[torch.Tensor, torch.Tensor]] = []

    def plan(self, query_start_loc, seq_lens, block_table, kv_heads, queries_per_kv):
        return None

    def write(self, layer, cache, key, value, rows, slots):
        raise AssertionError("not called after attention")

    def attend(self, layer, query, out, cache, batch, rows=None):
        raise AssertionError("not called after attention")

    def gather(self, layer, cache, slots):
        assert slots.device == cache.device, "the slots read are where the cache is"
        return torch.empty(slots.numel(), D, device=cache.device), torch.empty(slots.numel(), D, device=cache.device)

    def scatter(self, layer, cache, slots, keys, values):
        assert keys.device == values.device == cache.device

    def move(self, layer, cache, src, dst):
        self.moves.append((src, dst))

    def new_token_weights(self, layer, query, cache, batch, rows):
        return torch.zeros(batch.seq_lens.numel(), int(batch.seq_lens.max()), dtype=torch.float64, device=cache.device)

    def context_attention(self, layer, query, out, cache, page_ids, token_idx, lengths):
        raise AssertionError("not a selecting policy")


def decode_step(worker: WorkerState, pages: RequestPages) -> RelocatingStep:
    """One new token per head of the request, already given its slot (``RequestPages.append``)."""
    pages.append(1)
    lengths = torch.from_numpy(pages.lengths.copy())  # [layers, heads]
    rows = HeadRows(torch.zeros(H, dtype=torch.int64), torch.arange(H))
    qsl = torch.arange(H + 1, dtype=torch.int32)
    layers = [
        AttentionBatch(torch.tensor([0]), qsl, lengths[layer].int(), torch.zeros(H, 1), 1, None)
        for layer in range(LAYERS)
    ]
    carried = worker.mode.requests[REQ].carried
    slots = torch.tensor([carried.slot]) if worker.policy.inputs.attention else None
    return RelocatingStep(
        per_head=PerHeadBatch(
            torch.tensor([0]),
            rows,
            layers,
            torch.zeros(LAYERS, H),
            [REQ],
            pages.store,
            seq_lens=lengths.int(),
            tables=torch.zeros(LAYERS, H, 1),
            carried_slots=slots,
        )
    )


@pytest.mark.parametrize("policy", ["identity", "streaming", "snapkv", "pyramid", "keydiff", "h2o"])
def test_relocation_decode_and_eviction_read_nothing_back_from_the_cache(policy):
    budget = None if policy == "identity" else BUDGET
    kv_cache = torch.empty(16, H, BS, 2 * D, device=DEVICE)
    worker = WorkerState.of(
        KVPolicyConfig(policy=policy, budget=budget, window=8, page_pool="layer"),
        SimpleNamespace(kv_caches=[kv_cache] * LAYERS, requests={}),
    )
    worker.mode = make_mode(worker)
    pages = RequestPages(LAYERS, H, BS, list(range(-(-PROMPT // BS))))
    worker.mode.track(REQ).pages = pages
    ops = MetaOps()
    path = make_path(worker.mode, ops)
    query = torch.empty(PROMPT, H * G, D, device=DEVICE)
    window = torch.arange(PROMPT) if worker.policy.inputs.attention else torch.arange(PROMPT - 8, PROMPT)
    prompt = RelocatingStep(relocations=[Relocation(REQ, worker.policy, pages, PROMPT, PROMPT, budget, window)])
    for layer in range(LAYERS):
        path.after_attention(None, layer, query, kv_cache, prompt)
    assert pages.lengths.mean() == (PROMPT if budget is None else BUDGET)  # pyramid: on average over layers

    if worker.policy.schedule.in_decode:
        for _ in range(DECODE):
            step = decode_step(worker, pages)
            for layer in range(LAYERS):
                path.after_attention(None, layer, query[:1], kv_cache, step)
        evict = RelocatingStep(relocations=[Relocation(REQ, worker.policy, pages, None, None, None, torch.arange(0))])
        for layer in range(LAYERS):
            path.after_attention(None, layer, query[:0], kv_cache, evict)
        assert (pages.lengths == BUDGET).all()
        carried = worker.mode.requests[REQ].carried
        assert carried.scored == [worker.policy.inputs.attention] * LAYERS
        for layer in range(LAYERS) if worker.policy.inputs.attention else ():
            scores = worker.mode.scores.read(layer, carried.slot, BUDGET)
            assert scores.device == DEVICE and scores.shape == (H, BUDGET)

    expected_moves = LAYERS * (2 if worker.policy.schedule.in_decode else 1)
    assert len(ops.moves) == expected_moves
    for src, dst in ops.moves:
        assert src.device == DEVICE, "sources are picked where the cache is"
        assert dst.device.type == "cpu", "destinations come from the page table"
        assert src.shape == dst.shape
