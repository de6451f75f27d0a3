"""Decode batches in the fixed shapes of a full CUDA graph, run end to end on CPU.

On a GPU, vLLM replays a captured graph for a decode batch: the launches of
the capture, with their arguments. Here the Triton ops run interpreted
(``engine_run.py --ops triton``) and ``--fixed-decode`` makes the CPU
backend build decode batches as it does for those graphs
(``kvpolicy/vllm/worker/modes/fixed_decode.py``): every row as one-head sequences
over persistent buffers, relocated rows and rows still in vLLM's layout (the
60-token prompt is under the budget) in one call; ``adasnap`` stands for its
family (``identity``, streaming and the SnapKV family build the same step),
under vLLM's asynchronous scheduler with prefix caching, as on CUDA.
The same requests must give the same tokens as the per-head path; every
launch that reads the buffers must repeat, argument for argument, from step
to step (one argument list per layer and padded batch size, however many
steps ran; the model's activations aside, which a graph keeps at addresses
of its own); and none may compile a kernel variant the warm-up did not.
"""

import pytest

from kvpolicy.offline.model import prepare_tiny
from tests.e2e.test_ops_in_engine import assert_same_tokens

#: ``adasnap`` relocates the 200- and 129-token prompts; the 60-token one, under its budget, stays in vLLM's layout.
RUN = ("--policy", "adasnap", "--budget", "64", "--prompt-lens", "60", "200", "129", "--max-tokens", "12")
RUN += ("--chunk", "64", "--ops", "triton", "--page-pool", "layer")
RUN += ("--async-scheduling", "--prefix-caching")  # vLLM's defaults on CUDA
LAYERS = 3
#: Kernels whose every argument list differs by layer; the split decode's merge reads no layer's buffers.
PER_LAYER = ("_paged_attention_kernel", "_write_slots_kernel")


@pytest.fixture(scope="module")
def tiny_model():
    return prepare_tiny(num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_size=32)


@pytest.mark.engine
def test_fixed_shape_decode_gives_the_per_head_paths_tokens_with_the_same_launches_each_step(engine_run, tiny_model):
    per_head = engine_run(*RUN, model=tiny_model)
    fixed = engine_run(*RUN, "--fixed-decode", model=tiny_model)
    assert "fixed_decode_steps" not in per_head and fixed["async_scheduling"]
    steps = fixed["fixed_decode_steps"]
    assert sum(steps.values()) >= 10, f"decode batches ran in fixed shapes: {steps}"
    assert_same_tokens(per_head, fixed)
    assert fixed["counters"] == per_head["counters"], "the same requests were relocated and released"
    assert fixed["kv_cache_usage_end"] == 0.0
    variants = fixed["kernel_variants"]
    assert set(variants["serve"]) <= set(variants["start"]), "the warm-up compiled every variant they launch"
    launches = fixed["fixed_decode_launches"]
    for kernel in PER_LAYER:
        count, distinct = launches[kernel]
        assert count == LAYERS * sum(steps.values()), f"{kernel}: one launch per layer and step"
        assert distinct == LAYERS * len(steps), f"{kernel}: {distinct} argument lists over {len(steps)} sizes"
