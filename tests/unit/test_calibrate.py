"""OmniKV calibration: the last-token attention it measures, the similarity arithmetic, the proposal rule."""

import math
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpolicy.offline.calibrate import filter_ability, last_token_attention, layer_roles, propose, similarity_matrix


@pytest.fixture(scope="module")
def tiny_llama():
    """Random weights, scaled up (initializer_range 0.2) so attention is peaked and a position error would show."""
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_last_token_attention_is_the_last_row_of_full_attention(tiny_llama):
    input_ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = tiny_llama(input_ids, output_attentions=True).attentions
    expected = torch.stack([layer[0, :, -1] for layer in full])
    got = last_token_attention(tiny_llama, input_ids)
    assert got.shape == (4, 4, 40)
    assert expected.amax() > 5 / 40, "attention too flat to tell positions apart"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# [layers 3, heads 2, tokens 4]; each head's row sums to 1.
ATTENTION = torch.tensor(
    [
        [[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.6, 0.2]],  # max [.7 .1 .6 .2] -> T0 = {0, 2}; mean [.4 .1 .35 .15]
        [[0.1, 0.5, 0.2, 0.2], [0.3, 0.4, 0.1, 0.2]],  # max [.3 .5 .2 .2] -> T1 = {0, 1}; mean [.2 .45 .15 .2]
        [
            [0.3, 0.2, 0.15, 0.35],
            [0.05, 0.05, 0.1, 0.8],
        ],  # max [.3 .2 .15 .8] -> T2 = {0, 3}; mean [.175 .125 .125 .575]
    ]
)
SIMILARITY = torch.tensor(
    [
        [0.4 + 0.35, 0.2 + 0.15, 0.175 + 0.125],
        [0.4 + 0.1, 0.2 + 0.45, 0.175 + 0.125],
        [0.4 + 0.15, 0.2 + 0.2, 0.175 + 0.575],
    ]
)


def test_similarity_is_mass_of_head_mean_attention_on_the_max_over_heads_top_k():
    torch.testing.assert_close(similarity_matrix(ATTENTION, top_k=2), SIMILARITY)


def test_filter_ability_averages_the_next_span_layers():
    for span, expected in ((1, [0.35, 0.3]), (2, [0.325, 0.3]), (8, [0.325, 0.3])):
        ability = filter_ability(SIMILARITY, span)
        assert ability[:2] == pytest.approx(expected)
        assert math.isnan(ability[2])


def test_roles_and_kept_mass_follow_the_policy_layering():
    similarity = torch.arange(36, dtype=torch.float32).view(6, 6)
    roles = layer_roles(similarity, dense_layers=1, filter_layers=[1])
    assert roles == [
        ("dense", None),
        ("filter", None),
        ("full", None),
        ("sparse<-1", 9.0),
        ("sparse<-1", 10.0),
        ("sparse<-1", 11.0),
    ]
    assert layer_roles(similarity, dense_layers=6, filter_layers=[]) == [("dense", None)] * 6


NAN = math.nan


def test_proposal_starts_at_the_first_layer_past_the_threshold_and_steps_by_best_ability():
    #              0     1     2     3     4     5     6     7     8     9     10    11
    recall = [0.30, 0.90, 0.85, 0.90, 0.90, 0.90, 0.90, 0.90, 0.90, 0.90, 0.90, 0.90]
    ability = [0.90, 0.50, 0.85, 0.86, 0.90, 0.95, 0.80, 0.87, 0.90, 0.91, 0.99, NAN]
    # L0 = 2 (0 fails on recall, 1 on ability); span 4 -> next in [L + 2, L + 4]; 10 is too late to serve a layer.
    assert propose(recall, ability, threshold=0.8, span=4) == (2, [2, 5, 9])


def test_proposal_stops_where_no_layer_is_left_to_serve():
    recall = [0.9] * 6
    ability = [0.5, 0.5, 0.5, 0.9, 0.9, NAN]
    assert propose(recall, ability, threshold=0.8, span=4) == (3, [3])


def test_no_proposal_when_no_layer_reaches_the_threshold():
    assert propose([0.9] * 5, [0.5, 0.6, 0.7, 0.7, NAN], threshold=0.8, span=4) == (5, [])


def test_calibrate_imports_no_vllm():
    code = (
        "import sys, kvpolicy.offline.calibrate; print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
