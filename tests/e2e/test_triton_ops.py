"""The GPU path run end to end without a GPU: the real engine with kvpolicy's Triton ops instead of the CPU ops.

The kernels run in Triton's interpreter on the CPU cache (``KVPOLICY_OPS=triton``,
``TRITON_INTERPRET=1``), so every per-head write, attention call, token move and
score of these runs goes through ``triton_kernels/``; stock rows too, in steps
that mix them with per-head rows. The model is a tiny random-weight Llama made
locally (3 layers, 4 query heads over 2 KV heads, head size 32): interpreted
kernels are slow, and OmniKV needs a layer after its filter layer's neighbour.
Tokens must match the CPU ops run exactly; logprobs to float rounding.
"""

import json

import pytest

from kvpolicy.model import prepare_tiny

RUN = ("--prompt-lens", "40", "200", "129", "--max-tokens", "6", "--chunk", "64")
POLICIES = {
    "identity": ("--policy", "identity"),
    "adasnap": ("--policy", "adasnap", "--budget", "64"),
    "keydiff": ("--policy", "keydiff", "--budget", "64"),
    "omnikv": ("--policy", "omnikv", "--budget", "64", "--filter-layers", "0", "--dense-layers", "0"),
    # 32 recent tokens: the 200-token prompt has a page of distant tokens and is laid out.
    "pod": ("--policy", "pod", "--recent-tokens", "32"),
}
#: PoD's grouping of the tiny model: KV head 0 shares layer 0's distant logits with layers 1-2, head 1 layer 1's with 2.
POD_GROUPS = [[[0, 1, 2]], [[0], [1, 2]]]
LOGPROB_TOLERANCE = 1e-3  # fp32 model and cache; the kernels sum in another order than vLLM's CPU attention


@pytest.fixture(scope="module")
def tiny_model():
    return prepare_tiny(num_layers=3, num_heads=4, num_kv_heads=2, head_size=32)


@pytest.fixture(scope="module")
def pod_groups(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("pod") / "groups.json"
    path.write_text(json.dumps({"blocks": POD_GROUPS}))
    return str(path)


@pytest.mark.engine
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_triton_ops_in_the_engine_agree_with_the_cpu_ops(engine_run, tiny_model, pod_groups, policy):
    args = (*POLICIES[policy], *(("--pod-groups", pod_groups) if policy == "pod" else ()), *RUN)
    cpu = engine_run(*args, model=tiny_model)
    triton = engine_run(*args, "--ops", "triton", model=tiny_model)
    assert (cpu["ops"], triton["ops"]) == ("CPUOps", "TritonOps")
    if policy == "pod":
        assert cpu["counters"]["pod_layouts"] > 0, "a prompt was laid out and decoded on the sharing path"
    for i, (a, b) in enumerate(zip(cpu["requests"], triton["requests"], strict=True)):
        assert a["token_ids"] == b["token_ids"], f"request {i}: tokens differ"
        for step, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
            assert x.keys() == y.keys(), f"request {i}, step {step}: top tokens differ"
            worst = max(abs(x[t] - y[t]) for t in x)
            assert worst <= LOGPROB_TOLERANCE, f"request {i}, step {step}: logprobs differ by {worst}"
    assert triton["counters"] == cpu["counters"], "the same requests were relocated, compressed and released"
    assert triton["kv_cache_usage_end"] == 0.0, "every block is free again after the run"
