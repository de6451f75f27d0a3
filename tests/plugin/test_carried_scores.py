"""H2O/D2O's carried scores as rows of one tensor per layer: a step's one ``add`` for the whole batch equals each
request's own ``add_new_token``, bit for bit, as rows are taken, released and the tensor grows."""

import torch

from kvpolicy.policies.h2o import add_new_token
from kvpolicy.vllm.worker.modes.carried import CarriedScores

HEADS = 3


def test_a_batch_add_equals_each_request_adding_its_new_token():
    generator = torch.Generator().manual_seed(0)
    carried = CarriedScores(num_layers=2)
    alone: dict[int, torch.Tensor] = {}  # slot -> [heads, n], the reference
    for step in range(40):
        if step % 7 == 0:  # a request compressed: a new slot (sometimes a released one) with its scores
            if len(alone) > 2 and step % 14 == 0:
                gone = min(alone)
                carried.release(gone)
                del alone[gone]
            slot = carried.new_slot()
            alone[slot] = torch.rand(HEADS, int(torch.randint(1, 9, (1,), generator=generator)), generator=generator)
            alone[slot] = alone[slot].double()
            carried.write(1, slot, alone[slot])
        order = list(alone)[::-1]  # the batch's order, not the slots'
        width = max(alone[s].shape[1] for s in order) + 1
        weights = torch.zeros(len(order) * HEADS, width, dtype=torch.float64)
        for i, slot in enumerate(order):
            n = alone[slot].shape[1] + 1
            weights[i * HEADS : (i + 1) * HEADS, :n] = torch.rand(HEADS, n, generator=generator).double()
            alone[slot] = add_new_token(alone[slot], weights[i * HEADS : (i + 1) * HEADS, :n])
        carried.add(1, torch.tensor(order), weights)
        for slot, expected in alone.items():
            assert torch.equal(carried.read(1, slot, expected.shape[1]), expected), step
            assert not carried.layers[1][slot, :, expected.shape[1] :].any(), "zeros past each length"
    assert carried.layers[0] is None, "a layer nobody wrote holds nothing"
