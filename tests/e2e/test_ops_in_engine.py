"""kvpolicy's other tensor paths run end to end against the CPU ops: the real engine, the same requests.

* The GPU path without a GPU: kvpolicy's Triton ops in Triton's interpreter on the
  CPU cache (``engine_run.py --ops triton``), so every per-head
  write, attention call, token move and score goes through ``triton_kernels/``;
  stock rows too, in steps that mix them with per-head rows.
* The Triton kernels' warm-up: every variant the engine launches while it
  serves was compiled before (``kvpolicy_triton.launch``).
* The CPU ops' paths for pages vLLM's CPU ISA packs non-affinely (AMX, for
  bfloat16 on recent Xeons), which its C++ ops cannot address in place: forced
  here on this machine's affine pages (``--torch-paths``), so every token move and
  gather reads pages through the offset tables, and the C++ attention ops read
  a copy of their pages (``affine_pages``).

The model is a tiny random-weight Llama made locally (3 layers, 4 query heads
over 2 KV heads, head size 32): interpreted kernels are slow, and OmniKV needs
a layer after its filter layer's neighbour. Tokens must match the CPU ops run
exactly; logprobs to float rounding.
"""

import json

import pytest

from kvpolicy.offline.model import prepare_tiny
from kvpolicy.policies import POLICIES as POLICIES_BY_NAME
from kvpolicy.policies import Mode

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
#: flags of each other path -> the ops class it runs
OTHER_OPS = {"triton": (("--ops", "triton"), "TritonOps"), "torch-paths": (("--torch-paths",), "CPUOps")}
LOGPROB_TOLERANCE = 1e-3  # fp32 model and cache; the kernels sum in another order than vLLM's CPU attention


def assert_the_policy_acted(policy: str, counters: dict) -> None:
    """What makes a comparison of two runs prove something: the policy did its work in this one (two runs that
    both skipped it would agree)."""
    mode = POLICIES_BY_NAME[policy].mode
    if mode is Mode.SHARE:
        assert counters["pod_layouts"] > 0, "a prompt was laid out and decoded on the sharing path"
    elif mode is Mode.SELECT:
        assert 0 < counters["selected_pages"] < counters["context_pages"], "the filter layers left pages out"
    else:
        assert counters["relocated_requests"] > 0, "requests were laid out per head"
        if policy != "identity":  # keeps every token
            assert counters["compressed_requests"] > 0, "requests were compressed"


def assert_same_tokens(run: dict, other: dict, tolerance: float = LOGPROB_TOLERANCE) -> None:
    """Two engine runs of the same requests: the same tokens, the same top tokens, logprobs within ``tolerance``."""
    for i, (a, b) in enumerate(zip(run["requests"], other["requests"], strict=True)):
        assert a["token_ids"] == b["token_ids"], f"request {i}: tokens differ"
        for step, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
            assert x.keys() == y.keys(), f"request {i}, step {step}: top tokens differ"
            worst = max(abs(x[t] - y[t]) for t in x)
            assert worst <= tolerance, f"request {i}, step {step}: logprobs differ by {worst}"


@pytest.fixture(scope="module")
def tiny_model():
    return prepare_tiny(num_layers=3, num_heads=4, num_kv_heads=2, head_size=32)


@pytest.fixture(scope="module")
def pod_groups(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("pod") / "groups.json"
    path.write_text(json.dumps({"blocks": POD_GROUPS}))
    return str(path)


@pytest.mark.engine
@pytest.mark.parametrize("ops", sorted(OTHER_OPS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_other_ops_in_the_engine_agree_with_the_cpu_ops(engine_run, tiny_model, pod_groups, policy, ops):
    args = (*POLICIES[policy], *(("--pod-groups", pod_groups) if policy == "pod" else ()), *RUN)
    flags, ops_class = OTHER_OPS[ops]
    cpu = engine_run(*args, model=tiny_model)
    other = engine_run(*args, *flags, model=tiny_model)
    assert (cpu["ops"], other["ops"]) == ("CPUOps", ops_class)
    assert_the_policy_acted(policy, cpu["counters"])
    assert_same_tokens(cpu, other)
    assert other["counters"] == cpu["counters"], "the same requests were relocated, compressed and released"
    assert other["kv_cache_usage_end"] == 0.0, "every block is free again after the run"


@pytest.mark.engine
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_warm_up_compiles_every_kernel_variant_the_engine_launches(engine_run, tiny_model, pod_groups, policy):
    """What Triton would compile for each launch of kvpolicy's kernels while serving was compiled before (by
    the worker's warm-up, ``TritonOps.warm_up``): no variant compiles in the middle of a run."""
    args = (*POLICIES[policy], *(("--pod-groups", pod_groups) if policy == "pod" else ()), *RUN)
    variants = engine_run(*args, *OTHER_OPS["triton"][0], model=tiny_model)["kernel_variants"]
    assert variants["start"], "the warm-up launched the kernels"
    assert set(variants["serve"]) <= set(variants["start"]), sorted(set(variants["serve"]) - set(variants["start"]))
