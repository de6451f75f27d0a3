"""The real OpenAI-compatible server with ``--kv-policy adasnap --kv-budget 256``, through the real openai client."""

import time

import openai
import pytest
import requests

from benchmarks.server import scrape
from tests.e2e.conftest import SERVED_BUDGET, SERVED_NAME, SERVED_POLICY

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 120
LAYERS_X_KV_HEADS = 30 * 3
BLOCK_SIZE = 128  # vLLM's CPU default
GAUGE_NAMES = (
    "num_requests_compressed",
    "compressed_kv_blocks",
    "compressed_kv_bytes",
    "uncompressed_kv_bytes",
    "saved_kv_bytes",
)


def kvpolicy_metrics(server) -> dict[str, float]:
    """The served policy's kvpolicy samples, by short name (``released_blocks``, ``saved_kv_bytes``)."""
    return {
        name.split("{", 1)[0].removeprefix("vllm:kvpolicy_").removesuffix("_total"): value
        for name, value in scrape(server).items()
        if name.startswith("vllm:kvpolicy_") and f'policy="{SERVED_POLICY}"' in name
    }


def test_chat_completion_answers_paris(client):
    reply = client.chat.completions.create(model=SERVED_NAME, messages=FRANCE, max_tokens=20, temperature=0)
    assert "Paris" in reply.choices[0].message.content


def test_streaming_matches_the_whole_reply(client):
    whole = client.chat.completions.create(model=SERVED_NAME, messages=FRANCE, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=FRANCE, max_tokens=20, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].message.content


def test_long_prompt_is_compressed_and_blocks_released(client, server):
    before = kvpolicy_metrics(server)
    reply = client.completions.create(model=SERVED_NAME, prompt=LONG_PROMPT, max_tokens=16, temperature=0)
    assert reply.usage.prompt_tokens > 1000
    assert reply.usage.completion_tokens == 16
    after = kvpolicy_metrics(server)
    assert after["compressed_requests"] - before.get("compressed_requests", 0) == 1
    assert after["released_blocks"] > before.get("released_blocks", 0)
    kept = after["kept_kv_tokens"] - before.get("kept_kv_tokens", 0)
    assert kept == pytest.approx(SERVED_BUDGET * LAYERS_X_KV_HEADS, rel=0.02)


def test_per_request_budget_override(client, server):
    before = kvpolicy_metrics(server)
    client.completions.create(
        model=SERVED_NAME,
        prompt=LONG_PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"vllm_xargs": {"kv_budget": 64}},
    )
    kept = kvpolicy_metrics(server)["kept_kv_tokens"] - before.get("kept_kv_tokens", 0)
    assert kept == pytest.approx(64 * LAYERS_X_KV_HEADS, rel=0.02)


@pytest.mark.parametrize(
    "budget, message",
    [
        (-5, "kv_budget must be a positive integer"),
        (16, "larger than the observation window"),
        (10**6, "larger than the context limit"),
        (True, "kv_budget is a number of tokens per KV head, not a boolean"),  # JSON's true, not 1
    ],
)
def test_bad_request_budget_is_rejected_and_the_server_keeps_serving(client, budget, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(
            model=SERVED_NAME, prompt="Hello", max_tokens=4, extra_body={"vllm_xargs": {"kv_budget": budget}}
        )
    reply = client.chat.completions.create(model=SERVED_NAME, messages=FRANCE, max_tokens=20, temperature=0)
    assert "Paris" in reply.choices[0].message.content


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"kv_budgt": 128}, "unknown request option 'kv_budgt'"),
        ({"kv_policy": "keydiff"}, "kv_policy 'keydiff' cannot be served"),
    ],
)
def test_unknown_or_unservable_request_options_are_rejected(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message) as error:
        client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=4, extra_body={"vllm_xargs": extra})
    assert "kv_budget, kv_policy" in str(
        error.value
    ) or "none, adamix, adapyramid, adasnap, pyramid, rkv, snapkv" in str(error.value)
    reply = client.chat.completions.create(model=SERVED_NAME, messages=FRANCE, max_tokens=20, temperature=0)
    assert "Paris" in reply.choices[0].message.content


@pytest.mark.parametrize("policy, compressed", [("none", 0), ("snapkv", 1)])
def test_per_request_policy_none_stays_stock_and_family_members_compress(client, server, policy, compressed):
    before = kvpolicy_metrics(server)
    reply = client.completions.create(
        model=SERVED_NAME,
        prompt=LONG_PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"vllm_xargs": {"kv_policy": policy}},
    )
    assert reply.usage.completion_tokens == 4
    after = kvpolicy_metrics(server)
    assert after["compressed_requests"] - before.get("compressed_requests", 0) == compressed


def test_gauges_show_the_memory_a_running_request_saves_then_return_to_zero(client, server):
    stream = client.completions.create(
        model=SERVED_NAME,
        prompt=LONG_PROMPT,
        max_tokens=64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    for _ in range(8):
        next(chunks)
    during = kvpolicy_metrics(server)
    assert sum(1 for _ in chunks) > 0
    block_bytes = during["released_bytes"] / during["released_blocks"]
    assert during["num_requests_compressed"] == 1
    assert during["compressed_kv_bytes"] == during["compressed_kv_blocks"] * block_bytes
    assert during["saved_kv_bytes"] == during["uncompressed_kv_bytes"] - during["compressed_kv_bytes"]
    assert during["uncompressed_kv_bytes"] >= 2 * during["compressed_kv_bytes"] > 0
    deadline = time.monotonic() + 30
    while (after := kvpolicy_metrics(server))["num_requests_compressed"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [after[key] for key in GAUGE_NAMES] == [0] * len(GAUGE_NAMES)


def test_metrics_are_served(server):
    text = requests.get(f"{server}/metrics", timeout=30).text
    assert "vllm:num_requests_running" in text
    assert "vllm:kvpolicy_released_bytes_total" in text


SYSTEM = (
    "You are a librarian. The library opens at nine and closes at six. Members may borrow five books "
    "for three weeks; late returns cost ten cents a day. "
) * 40
TURNS = ("When does the library open?", "How many books may I borrow?", "What does a late return cost?")


def total(samples: dict[str, float], metric: str) -> float:
    return sum(value for name, value in samples.items() if name.split("{", 1)[0] == metric)


def test_a_three_turn_chat_hits_the_prefix_cache_through_the_server(client, server):
    before = scrape(server)
    messages = [{"role": "system", "content": SYSTEM}]
    prompt_tokens = []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=24, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        prompt_tokens.append(reply.usage.prompt_tokens)
    after = scrape(server)
    assert prompt_tokens[0] > 1000
    hits = total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total")
    assert hits >= 2 * 4 * BLOCK_SIZE  # turns 2 and 3 read at least 4 blocks of the turns before
    compressed = "vllm:kvpolicy_compressed_requests_total"
    assert total(after, compressed) - total(before, compressed) == 3
    deadline = time.monotonic() + 30
    while total(scrape(server), "vllm:kv_cache_usage_perc") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert total(scrape(server), "vllm:kv_cache_usage_perc") == 0
