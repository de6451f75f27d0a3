#!/usr/bin/env bash
# Run the `kvpolicy` image (`make image`) on a loopback port and have it answer a chat completion
# through the OpenAI API, compress a prompt longer than its budget, show kvpolicy's counters and the
# C++ ops it loaded, and stop it (`make image-check`).
set -euo pipefail
cd "$(dirname "$0")/.."
docker/engine.sh
PORT=${PORT:-18000}
name=kvpolicy-check-$$
# vLLM needs more shared memory than Docker's default 64 MiB (its engine refuses to start with less).
docker run -d --name "$name" --shm-size=1g -p "127.0.0.1:$PORT:8000" kvpolicy >/dev/null
trap 'docker rm -f "$name" >/dev/null' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  if [ "$(docker inspect -f '{{.State.Running}}' "$name")" != true ] \
     || docker logs "$name" 2>&1 | grep -q "initialization failed"; then
    docker logs "$name" 2>&1 | grep -v shm_broadcast | tail -30
    echo "the server in the container did not start" >&2
    exit 1
  fi
  sleep 1
done
ask() {
  curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"SmolLM2-135M-Instruct\", \"temperature\": 0, \"max_tokens\": 20,
         \"messages\": [{\"role\": \"user\", \"content\": \"$1\"}]}"
}
reply=$(ask "What is the capital of France?")
echo "$reply"
echo "$reply" | grep -q Paris || { echo "the container did not answer Paris" >&2; exit 1; }
# A prompt longer than the budget (256 tokens), so the policy compresses it with kvpolicy's C++ ops.
ask "$(printf 'The sky is blue and the grass is green. %.0s' $(seq 60))What colour is the grass?" \
  | grep -o '"content":"[^"]*"'
counters=$(curl -sf "http://127.0.0.1:$PORT/metrics" \
  | grep -E '^vllm:kvpolicy_(relocated_requests|compressed_requests|released_blocks)_total')
echo "$counters"
echo "$counters" | grep -q '^vllm:kvpolicy_compressed_requests_total.* [1-9]' \
  || { echo "the container compressed no request" >&2; exit 1; }
docker exec "$name" python -c 'import kvpolicy_csrc._C as c; print("kvpolicy C++ ops:", c.__file__)'
echo "image check passed: the container answered through the OpenAI API and compressed a long prompt"
