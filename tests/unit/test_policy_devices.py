"""Policies create every tensor where their inputs are: none on the default device.

Each policy runs twice on CPU inputs: as usual, then with ``meta`` as the
default device (``with torch.device("meta")``). A tensor made there without
``device=`` holds no data and cannot meet the inputs (an op that mixes them
raises, a host read such as ``.tolist()`` has nothing to read), so equal
results, bit for bit and on the CPU, show that a policy given CUDA tensors
keeps its work on the GPU. This is the check a machine without a GPU can make.
"""

from dataclasses import fields

import pytest
import torch

from kvpolicy.policies import CompressedKV, PromptKV, make_policy
from kvpolicy.policies.h2o import add_new_token, attention_column_sums, new_token_attention
from kvpolicy.policies.keydiff import keydiff_block_step
from kvpolicy.policies.omnikv import SELECTORS, context_scores, page_sums
from kvpolicy_triton import shared_attention_reference as shared_attention

H, G, D, L = 3, 3, 16, 150
BUDGET = 40

#: Every policy that chooses tokens, with options that make a 150-token prompt exercise its scoring.
POLICY_OPTIONS = {
    "identity": {},
    "snapkv": {"window": 8, "pool_kernel": 5},
    "adasnap": {"window": 8, "pool_kernel": 5},
    "pyramid": {"window": 8, "pool_kernel": 5},
    "adapyramid": {"window": 8, "pool_kernel": 5},
    "adamix": {"window": 8, "combine": "union"},
    "adamix-blend": {"window": 8, "combine": "blend", "mix": 0.3},
    "streaming": {"sink_tokens": 4},
    "keydiff": {},
    "h2o": {"recent_fraction": 0.25},
    "d2o": {},
    "d2o-no-merge": {"merge": False},
}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same(got, expected) -> None:
    """Equal bit for bit, same dtype, both on the CPU: tensors, or lists, tuples, dataclasses of them."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu" == expected.device.type
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(bits(got), bits(expected))
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_same(a, b)
    elif isinstance(expected, CompressedKV):
        for field in fields(CompressedKV):
            assert_same(getattr(got, field.name), getattr(expected, field.name))
    else:
        assert got == expected


def on_meta_default(run):
    """``run()`` as usual, then with ``meta`` the default device; both results, the second checked equal."""
    expected = run()
    with torch.device("meta"):
        got = run()
    assert_same(got, expected)
    return expected


@pytest.fixture(params=[0, 1, 2])
def prompt(request):
    gen = torch.Generator().manual_seed(request.param)
    keys, values = torch.randn(2, H, L, D, generator=gen)
    queries = torch.randn(H * G, L, D, generator=gen) * 2
    return PromptKV(keys, queries[:, -8:], layer=request.param, num_layers=4, queries=queries, values=values)


@pytest.mark.parametrize("case", POLICY_OPTIONS)
def test_every_policy_compresses_on_its_inputs_device(prompt, case):
    policy = make_policy(case.split("-")[0], **POLICY_OPTIONS[case])
    result = on_meta_default(lambda: policy.compress(prompt, BUDGET))
    assert all(kept.numel() for kept in result.kept)
    on_meta_default(lambda: policy.keep(prompt, L + 1))  # a prompt within the budget: kept whole


@pytest.mark.parametrize("case", ["h2o", "d2o"])
def test_decode_eviction_with_carried_scores_stays_on_the_inputs_device(prompt, case):
    """An eviction pass: the cache so far with the scores (and threshold) the prompt's compression carried,
    after new tokens added their weights."""
    policy = make_policy(case, **POLICY_OPTIONS[case])
    first = policy.compress(prompt, BUDGET)
    kept = torch.stack(first.kept)
    keys = first.keys if first.keys is not None else prompt.keys.gather(1, kept[..., None].expand(-1, -1, D))
    values = first.values if first.values is not None else prompt.values.gather(1, kept[..., None].expand(-1, -1, D))
    gen = torch.Generator().manual_seed(7)
    scores = first.scores
    for _ in range(5):
        new_keys, new_values = torch.randn(2, H, 1, D, generator=gen)
        keys, values = torch.cat([keys, new_keys], dim=1), torch.cat([values, new_values], dim=1)
        query = torch.randn(H, G, D, generator=gen)
        lengths = torch.full((H,), keys.shape[1])
        weights = on_meta_default(lambda: new_token_attention(keys, lengths, query))
        scores = on_meta_default(lambda: add_new_token(scores, weights))
    cache = PromptKV(keys, values=values, scores=scores, threshold=first.threshold)
    on_meta_default(lambda: policy.compress(cache, BUDGET))


def test_d2o_layer_budgets_from_observations_stay_on_the_inputs_device(prompt):
    """The engine's order: every layer observed, the budgets across layers, each layer compressed."""
    d2o = make_policy("d2o")
    layers = [prompt, PromptKV(prompt.keys.flip(1), queries=prompt.queries, values=prompt.values)]
    observations = on_meta_default(lambda: [d2o.observe(layer, BUDGET) for layer in layers])
    budgets = on_meta_default(lambda: d2o.layer_budgets(observations, BUDGET))
    for layer, observation, budget in zip(layers, observations, budgets):
        on_meta_default(lambda: d2o.compress(layer, budget, observation))


def test_column_sums_over_the_last_queries_stay_on_the_inputs_device(prompt):
    on_meta_default(lambda: attention_column_sums(prompt.keys, prompt.queries[:, -20:], chunk=7))


def test_keydiff_block_steps_stay_on_the_inputs_device(prompt):
    cached = prompt.keys[:, :30]
    on_meta_default(lambda: keydiff_block_step(cached, prompt.keys[:, 30:50], BUDGET))
    on_meta_default(lambda: keydiff_block_step(cached[:, :10], prompt.keys[:, 30:35], BUDGET))


@pytest.mark.parametrize("selector", SELECTORS)
def test_omnikv_context_and_page_scores_stay_on_the_inputs_device(selector):
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, H, 4, 32, D, generator=gen)
    queries = torch.randn(2, H * G, 4, D, generator=gen)
    lengths = torch.tensor([128, 90])
    scores = on_meta_default(lambda: context_scores(queries, keys, lengths, selector))
    on_meta_default(lambda: page_sums(scores, 32))


def test_pod_shared_attention_stays_on_the_inputs_device():
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(G, D, generator=gen)
    keys, values = torch.randn(2, 20, D, generator=gen)
    distant_logits, distant_values = torch.randn(G, 30, generator=gen), torch.randn(30, D, generator=gen)
    on_meta_default(lambda: shared_attention(query, keys, values, None, None, 0.25))
    on_meta_default(lambda: shared_attention(query, keys, values, distant_logits, distant_values, 0.25, tau=0.5))
