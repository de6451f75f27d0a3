"""PoD post-training (``kvpolicy.offline.train_pod``) on a tiny random Llama: the sharing attention against eager attention
and against eq. 3-4 written from the paper, and a resumable two-step run whose export reloads as a plain model."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from kvpolicy.offline.train_pod import (
    ATTENTION_NAME,
    CHECKPOINT,
    SharedAttention,
    export,
    held_out_loss,
    train,
    use_sharing,
)
from kvpolicy.policies.pod import LayerGroups

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 4, 2, 16, 128
SINKS, RECENT = 3, 5
# KV head 0: layers 1-3 reuse layer 1's distant logits; KV head 1: layer 1 reuses layer 0's.
GROUPS = LayerGroups.of([[[0], [1, 2, 3]], [[0, 1], [2], [3]]])


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=2 * HEADS * HEAD_DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


class RecordingAttention(SharedAttention):
    """Keeps every layer's query, key, value and output of the last forward."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = {}

    def __call__(self, module, query, key, value, *args, **kwargs):
        output = super().__call__(module, query, key, value, *args, **kwargs)
        self.seen[module.layer_idx] = (query[0], key[0], value[0], output[0][0])
        return output


def reference_row(t, q_own, k_own, v_own, q_low, k_low, scale):
    """Eq. 3-4 for query position t of one query head, term by term: ``o = g * o_P + (1 - g) * o_D``."""
    proximal = [j for j in range(t + 1) if j < SINKS or t - j < RECENT]
    distant = [j for j in range(t + 1) if j not in proximal]
    a_p = (k_own[proximal].double() @ q_own.double()) * scale
    o_p = a_p.softmax(0) @ v_own[proximal].double()
    if not distant:
        return o_p
    a_d = (k_low[distant].double() @ q_low.double()) * scale
    o_d = a_d.softmax(0) @ v_own[distant].double()
    g = a_p.exp().sum() / (a_p.exp().sum() + a_d.exp().sum())
    return g * o_p + (1 - g) * o_d


@torch.no_grad()
def test_without_shared_layers_the_sharing_attention_is_eager_attention():
    model, window = tiny_model(), tokens(40, seed=1)
    eager = model(window).logits
    use_sharing(model, SharedAttention(LayerGroups.single_layers(LAYERS, KV_HEADS), SINKS, RECENT))
    torch.testing.assert_close(model(window).logits, eager, atol=1e-5, rtol=0)
    use_sharing(model, SharedAttention(GROUPS, SINKS, RECENT))
    assert not torch.allclose(model(window).logits, eager, atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("t", [5, 17, 39])
def test_a_shared_layers_row_is_eq_3_4_with_the_lowest_layers_query_and_keys(t):
    model, window = tiny_model(), tokens(40, seed=2)
    recording = RecordingAttention(GROUPS, SINKS, RECENT)
    use_sharing(model, recording)
    model(window)
    scale = model.model.layers[0].self_attn.scaling
    group = HEADS // KV_HEADS
    lowest = GROUPS.lowest()
    for layer in range(LAYERS):
        query, key, value, output = recording.seen[layer]
        for head in range(HEADS):
            kv_head, low = head // group, lowest[layer][head // group]
            low_query, low_key = recording.seen[low][:2]
            expected = reference_row(
                t, query[head, t], key[kv_head], value[kv_head], low_query[head, t], low_key[kv_head], scale
            )
            torch.testing.assert_close(output[t, head].double(), expected, atol=1e-5, rtol=1e-5)


def test_gradients_reach_the_lowest_layer_through_the_shared_logits():
    sharing = SharedAttention(GROUPS, SINKS, RECENT)
    torch.manual_seed(3)
    inputs, outputs = {}, {}
    for layer in (0, 1, 3):
        inputs[layer] = [
            torch.randn(1, heads, 40, HEAD_DIM, requires_grad=True) for heads in (HEADS, KV_HEADS, KV_HEADS)
        ]
        module = SimpleNamespace(layer_idx=layer, training=True)
        outputs[layer] = sharing(module, *inputs[layer], None, scaling=HEAD_DIM**-0.5)[0]
    low_query, low_key, low_value = inputs[1]
    grads = torch.autograd.grad(outputs[3].sum(), (low_query, low_key, low_value), allow_unused=True)
    # Layer 3 reuses layer 1's logits for KV head 0 (query heads 0 and 1) only, and layer 1's values never.
    assert grads[0][0, :2].abs().sum() > 0 and grads[0][0, 2:].abs().sum() == 0
    assert grads[1][0, 0].abs().sum() > 0 and grads[1][0, 1].abs().sum() == 0
    assert grads[2] is None


def test_training_runs_resumes_at_the_saved_step_and_exports_a_plain_llama(tmp_path):
    out = tmp_path / "pod"
    windows = [tokens(32, seed=10 + i) for i in range(3)]
    model = tiny_model()
    sharing = SharedAttention(GROUPS, SINKS, RECENT)
    before = held_out_loss(model, sharing, tokens(32, seed=99))
    assert all(math.isfinite(loss) for loss in before.values()) and before["full_attention"] != before["sharing"]

    first = train(model, windows[:2], out, lr=1e-3, save_every=1, log={"steps": []})
    assert [step["step"] for step in first["steps"]] == [1, 2]
    assert all(math.isfinite(step["loss"]) for step in first["steps"])
    assert torch.load(out / CHECKPOINT, weights_only=True)["step"] == 2
    assert json.loads((out / "train_log.json").read_text())["steps"] == first["steps"]
    with torch.no_grad():
        third_loss = model(windows[2], labels=windows[2]).loss.item()

    with pytest.raises(SystemExit, match="other settings"):
        train(tiny_model(), windows, out, lr=1e-3, save_every=1, log={"settings": {"steps": 3}, "steps": []})
    resumed_model = tiny_model()
    use_sharing(resumed_model, sharing)
    resumed = train(resumed_model, windows, out, lr=1e-3, save_every=1, log={"steps": []})
    assert resumed["steps"][:2] == first["steps"]
    assert [step["step"] for step in resumed["steps"]] == [1, 2, 3]
    assert resumed["steps"][2]["loss"] == pytest.approx(third_loss, abs=1e-5)

    export(resumed_model, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert ATTENTION_NAME not in (out / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    window = tokens(32, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(window).logits, resumed_model(window).logits, atol=1e-5, rtol=0)
