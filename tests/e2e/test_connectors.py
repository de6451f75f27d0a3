"""kvpolicy beside another KV connector in vLLM's MultiConnector, on the real engine.

vLLM's example connector saves each new prompt's KV to files and loads it
for a prompt it has seen (external tokens, like a prefix-cache hit); it runs
on vLLM's CPU platform, where the offloading connectors do not. Beside
``omnikv`` (which leaves blocks as vLLM wrote them) one engine saves with
prefix caching on, a second engine on the same files loads, and both give
the outputs of ``omnikv`` alone, with kvpolicy's counters reported through
the MultiConnector and every block free. Beside ``adasnap``, which packs
pages into the blocks that connector saves, the engine refuses to start and
says why (kvpolicy/vllm/connectors.py).
"""

import json

import pytest

pytestmark = pytest.mark.engine

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
