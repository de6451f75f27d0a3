"""Which policies decode in fixed shapes, and how a step that reads a prompt stays out of vLLM's full graphs."""

from types import SimpleNamespace

import pytest

from kvpolicy.policies import POLICIES
from kvpolicy.vllm.internals import CUDAGraphMode, prompt_rows_scheduled
from kvpolicy.vllm.patches import forbid_full_graphs_while
from kvpolicy.vllm.worker.modes.fixed_decode import buffer_bytes, refusal

#: Policies whose decode step is a write and an attention call per layer, nothing after.
FIXED = {"identity", "snapkv", "adasnap", "pyramid", "adapyramid", "adamix", "adaheavy", "rkv", "streaming"}


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"none"}))
def test_only_policies_without_host_work_in_decode_run_in_fixed_shapes(name):
    why_not = refusal(POLICIES[name], offload=False)
    assert (why_not is None) == (name in FIXED), why_not
    assert refusal(POLICIES["adasnap"], offload=True) is not None, "offloaded layers load from the host pool"


def test_the_buffers_are_a_table_a_length_and_a_slot_per_layer_and_one_head_sequence():
    # Llama-3.1-8B's shape at 256 rows and 5,120 tokens in 16-token blocks: 32 x 256 x 8 sequences.
    assert buffer_bytes(32, 8, 256, 5120, 16) == 32 * 256 * 8 * (320 * 4 + 4 + 8)


def test_full_graphs_are_left_out_while_a_step_reads_a_prompt():
    def dispatch(num_tokens, uniform_decode=False, valid_modes=None, invalid_modes=None):
        return valid_modes, invalid_modes

    runner = SimpleNamespace(cudagraph_dispatcher=SimpleNamespace(dispatch=dispatch))
    reading = [False]
    forbid_full_graphs_while(runner, lambda: reading[0])
    dispatch = runner.cudagraph_dispatcher.dispatch
    assert dispatch(8, uniform_decode=True) == (None, None)
    reading[0] = True
    assert dispatch(8, uniform_decode=True) == (None, {CUDAGraphMode.FULL})
    full = {CUDAGraphMode.FULL}
    assert dispatch(8, valid_modes=full) == (full, None), "a data-parallel re-dispatch keeps the agreed mode"


def test_a_step_reads_a_prompt_with_a_new_request_or_a_running_one_short_of_its_prompt():
    runner = SimpleNamespace(requests={"a": SimpleNamespace(num_prompt_tokens=100)})

    def output(new=(), cached=(), computed=()):
        cached_reqs = SimpleNamespace(req_ids=list(cached), num_computed_tokens=list(computed))
        return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_reqs)

    assert not prompt_rows_scheduled(output(cached=["a"], computed=[100]), runner), "decoding"
    assert prompt_rows_scheduled(output(cached=["a"], computed=[99]), runner), "its prompt's last token"
    assert prompt_rows_scheduled(output(new=["b"]), runner)
    assert prompt_rows_scheduled(output(cached=["c"], computed=[500]), runner), "resumed, not in the runner yet"
