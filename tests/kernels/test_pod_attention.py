"""pod_attention against its reference and against eq. 3-4 in the paper's gate form, written here: a lowest layer
that stores its distant logits, then a layer whose sequences either share them (with packed distant values) or keep
every key."""

import math

import pytest
import torch

from kvpolicy_triton import flat, pod_attention_reference
from tests.kernels.paging import DEVICE, DTYPES, IMPLEMENTATIONS, LAYOUTS, TOLERANCE, index, make_cache, shuffled_pages

QUERY_HEADS, HEAD_SIZE, SINKS = 6, 32, 3
# (length, distant count) of each (row, KV head) in the lowest layer: ragged, odd and even counts, around
# page boundaries, and a head with no distant token.
SEQUENCES = [[(40, 21), (17, 0), (33, 30)], [(9, 5), (50, 33), (24, 16)], [(36, 1), (20, 16), (41, 7)]]
SKIP_LOGITS = 1e-4  # the reference and the kernels store the same float32 logits, summed in different orders


def pages_for(pool: list[int], count: int, width: int) -> list[int]:
    """``count`` pages taken from ``pool``, padded to ``width`` with a page the sequence never reads."""
    taken = [pool.pop() for _ in range(count)]
    return taken + [taken[0] if taken else 0] * (width - count)


def sequences(kv_heads: int, bs: int, pool: list[int], share: bool):
    """Index tensors of one call over every (row, head); ``share``: odd (row + head) sequences share (they read
    the lowest layer's logits from the row ``s`` it wrote, their distant tokens packed), the others keep every
    key and write their distant logits at row ``len(seqs) + s``."""
    seqs = [(r, h) for r in range(len(SEQUENCES)) for h in range(kv_heads)]
    width = -(-max(n for row in SEQUENCES for n, _ in row) // bs) + 1
    cols = {name: [] for name in ("token_of", "head_of", "lengths", "start", "count", "read", "write")}
    tables, value_tables = [], []
    for s, (r, h) in enumerate(seqs):
        n, count = SEQUENCES[r][h]
        shares = share and (r + h) % 2 == 1
        main = n - count if shares else n
        tables.append(pages_for(pool, -(-main // bs), width))
        pairs = -(-count // 2)
        value_tables.append(pages_for(pool, -(-pairs // bs), width) if shares else [0] * width)
        row = dict(
            token_of=r,
            head_of=h,
            lengths=main,
            start=SINKS,
            count=count,
            read=s if shares else -1,
            write=-1 if shares else s + len(seqs) * share,
        )
        for name, value in row.items():
            cols[name].append(value)
    return seqs, [
        index(cols["token_of"]),
        index(cols["head_of"], torch.int64),
        index(tables),
        index(cols["lengths"]),
        index(value_tables),
        index(cols["start"]),
        index(cols["count"]),
        index(cols["read"]),
        index(cols["write"], torch.int64),
    ]


@pytest.mark.parametrize("tau", [None, 0.3], ids=["no_tau", "tau"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_heads", [3, 2], ids=["G2", "G3"])
@pytest.mark.parametrize("ops", list(IMPLEMENTATIONS))
def test_pod_attention(ops, dtype, layout, kv_heads, tau):
    bs = LAYOUTS[layout]
    blocks = 2 * len(SEQUENCES) * kv_heads * (-(-60 // bs) + 1)
    cache, geom = make_cache(layout, blocks, kv_heads, HEAD_SIZE, dtype)
    pool = shuffled_pages(blocks * kv_heads).tolist()
    generator = torch.Generator().manual_seed(11)
    query = (2 * torch.randn(len(SEQUENCES), QUERY_HEADS, HEAD_SIZE, generator=generator)).to(DEVICE, dtype)
    group, scale = QUERY_HEADS // kv_heads, 1 / math.sqrt(HEAD_SIZE)
    seqs = len(SEQUENCES) * kv_heads
    logits = torch.zeros(2 * seqs, group, 40, device=DEVICE)
    want_logits = logits.clone()
    lowest, shared = sequences(kv_heads, bs, pool, False)[1], sequences(kv_heads, bs, pool, True)[1]

    for call in (lowest, shared):
        out = torch.zeros_like(query)
        want_out = torch.zeros_like(query)
        got = IMPLEMENTATIONS[ops].pod_attention(query, out, cache, geom, *call, logits, scale, kv_heads, tau)
        want = pod_attention_reference(query, want_out, cache, geom, *call, want_logits, scale, kv_heads, tau)
        assert got.dtype == torch.bool and got.shape == (seqs, group)
        torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])
        torch.testing.assert_close(logits, want_logits, rtol=SKIP_LOGITS, atol=SKIP_LOGITS)
        assert torch.equal(got, want)
    if tau is not None:
        assert want.any() and not want.all(), "tau skips some heads' distant part and keeps others'"

    # The sharing sequences against eq. 3-4 as the paper writes them, o = g o_P + (1 - g) o_D (the reference is
    # one softmax over both sets of logits), from the same pages.
    storage = flat(cache)
    token_of, head_of, table, lengths, value_table, _, counts, read_from, _ = (t.cpu() for t in shared)

    def rows_at(pages, n, value):
        positions = torch.arange(n)
        return storage[geom.element_index(pages[positions // bs] * bs + positions % bs, value)].float()

    # (A sequence with no distant token has nothing to skip: its gate is 1.)
    for s in torch.nonzero((read_from >= 0) & (counts > 0)).flatten().tolist():
        n, count, head = int(lengths[s]), int(counts[s]), int(head_of[s])
        q = query[int(token_of[s]), head * group : (head + 1) * group]
        own = (q.double() @ rows_at(table[s].long(), n, False).double().T) * scale
        pairs = -(-count // 2)
        packed = [rows_at(value_table[s].long(), pairs, value) for value in (False, True)]
        far_values = torch.stack(packed, dim=1).flatten(0, 1)[:count].double()
        far = logits[int(read_from[s]), :, :count].double()
        proximal = own.softmax(-1) @ rows_at(table[s].long(), n, True).double()
        gate = own.exp().sum(-1) / (own.exp().sum(-1) + far.exp().sum(-1))
        skipped = gate >= (math.inf if tau is None else tau)
        joint = gate[:, None] * proximal + (1 - gate[:, None]) * (far.softmax(-1) @ far_values)
        result = torch.where(skipped[:, None], proximal, joint).float()
        torch.testing.assert_close(
            out[int(token_of[s]), head * group : (head + 1) * group].float(), result, **TOLERANCE[dtype]
        )
        assert torch.equal(got[s].cpu(), skipped.cpu())
