"""kvpolicy beside another KV connector in vLLM's MultiConnector, on the real engine.

vLLM's example connector saves each new prompt's KV to files and loads it for a prompt it has seen: beside ``omnikv``
one engine saves with prefix caching on, a second loads from the same files, both give ``omnikv``'s outputs alone with
kvpolicy's counters reported and every block free; beside ``adasnap``, which packs pages into the blocks it saves,
the engine refuses to start and says why (``startup/connector_chain.py``). vLLM's offloading connector with
kvpolicy's spec (``scheduler/prefix_offload.py``) beside ``adasnap``: a prompt after a shared prefix loads from host
chunks the prefix blocks packing took out of the prefix cache, gives the outputs of the run without the connector,
and never receives a block copied after a relocation.
"""

import json

import pytest

from tests.e2e.conftest import assert_same_outputs, shared_prefix_args

pytestmark = pytest.mark.engine

OFFLOADING = json.dumps(
    {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 28},
    }
)
BLOCK_SIZE = 128

#: Prompts read in one step each: the example connector saves a prompt's every block when first scheduled.
RUN = ("--max-tokens", "6", "--prompt-lens", "40", "129", "300", "--chunk", "2048")
OMNIKV = ("--policy", "omnikv", "--budget", "64")


def example_connector(path) -> str:
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)},
        }
    )


def test_a_saving_and_loading_connector_beside_a_policy_that_leaves_blocks_alone(engine_run, tmp_path):
    alone = engine_run(*OMNIKV, *RUN, "--prefix-caching")
    beside = example_connector(tmp_path / "kv")
    saving = engine_run(*OMNIKV, *RUN, "--prefix-caching", "--kv-transfer-config", beside)
    assert any((tmp_path / "kv").iterdir()), "the connector saved nothing"
    # Without vLLM's own prefix cache, a second engine's hits come from the connector's files.
    loading = engine_run(*OMNIKV, *RUN, "--kv-transfer-config", beside)
    # It matches whole blocks of a prompt but its last token: 128-token blocks of the 300-token prompt only.
    assert [r["cached_tokens"] for r in loading["requests"]] == [0, 0, 256]
    for run in (saving, loading):
        assert [r["token_ids"] for r in run["requests"]] == [r["token_ids"] for r in alone["requests"]]
        assert run["counters"]["selected_pages"] == alone["counters"]["selected_pages"] > 0
        assert run["kv_cache_usage_end"] == 0


def test_a_connector_that_would_save_packed_pages_is_refused_at_startup(engine_run, tmp_path):
    beside = example_connector(tmp_path)
    refused = engine_run("--policy", "adasnap", "--budget", "64", *RUN, "--kv-transfer-config", beside, fails=True)
    assert "cannot run beside ExampleConnector" in refused


#: The second prompt's cached prefix blocks without and with the connector, policy by policy, as
#: test_prefix_caching.py runs them (its runs without the connector are the same runs).
SECOND_PROMPT_BLOCKS = [
    (("adasnap",), 13, 15),
    (("pod", "--recent-tokens", "128", "--pod-delta", "0.5"), 3, 15),
    (("omnikv", "--offload", "1"), 10, 15),
]


@pytest.mark.parametrize(
    "policy, alone_blocks, beside_blocks", SECOND_PROMPT_BLOCKS, ids=["adasnap", "pod", "omnikv-offload"]
)
def test_the_offloading_connector_serves_prefix_blocks_that_a_policy_took_out_of_the_prefix_cache(
    engine_run, policy, alone_blocks, beside_blocks
):
    """Read 256 tokens a step, the first prompt's blocks up to its last step are copied to host chunks before
    the policy writes pages into some of them (relocation, PoD's layout, OmniKV's offload); the second prompt
    finds the rest of its prefix there."""
    run = shared_prefix_args(policy[0], *policy[1:], "--prompt-lens", "100", "150", "--prefix-caching")
    alone = engine_run(*run)
    beside = engine_run(*run, "--kv-transfer-config", OFFLOADING)
    assert [r["cached_tokens"] for r in alone["requests"]] == [0, alone_blocks * BLOCK_SIZE]
    assert [r["cached_tokens"] for r in beside["requests"]] == [0, beside_blocks * BLOCK_SIZE]
    assert beside["prefix_cache_hits"] == alone["prefix_cache_hits"]  # the other blocks came from the connector
    assert beside["counters"]["released_blocks"] == alone["counters"]["released_blocks"] > 0
    assert_same_outputs(alone, beside)
    assert beside["kv_cache_usage_end"] == 0


def test_blocks_copied_after_their_prompt_was_packed_never_reach_a_later_prompt(engine_run):
    """Each prompt read in one step: every block of the first is copied at the start of the step after the one
    that packed it, and kvpolicy's spec drops those copies. Without that (measured by disabling it), the second
    prompt loaded 15 blocks of the first's pages as its prefix and its tokens differed."""
    run = shared_prefix_args("adasnap", "--prompt-lens", "100", "150", "--prefix-caching", "--chunk", "4096")
    alone = engine_run(*run)
    beside = engine_run(*run, "--kv-transfer-config", OFFLOADING)
    assert [r["cached_tokens"] for r in beside["requests"]] == [r["cached_tokens"] for r in alone["requests"]]
    assert_same_outputs(alone, beside)
    assert beside["kv_cache_usage_end"] == 0
