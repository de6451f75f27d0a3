"""The real OpenAI-compatible server with ``--kv-policy identity``, through the real openai client."""

import requests

from tests.e2e.conftest import SERVED_NAME

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


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


def test_long_prompt_completion(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 120
    reply = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert reply.usage.prompt_tokens > 1000
    assert reply.usage.completion_tokens == 16


def test_metrics_are_served_with_kvpolicy_counters(client, server):
    client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=4)
    text = requests.get(f"{server}/metrics", timeout=30).text
    assert "vllm:num_requests_running" in text
    relocated = [
        line for line in text.splitlines()
        if line.startswith("vllm:kvpolicy_relocated_requests_total{") and 'policy="identity"' in line
    ]
    assert relocated and float(relocated[0].rsplit(" ", 1)[1]) >= 1
