#!/usr/bin/env bash
# Run the `kvpolicy` image (`make image`) on a loopback port and have it answer a chat completion
# through the OpenAI API, then show its kvpolicy metrics and C++ ops and stop it (`make image-check`).
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
reply=$(curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 20,
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}')
echo "$reply"
curl -sf "http://127.0.0.1:$PORT/metrics" | grep -E '^vllm:kvpolicy_(num_requests_compressed|relocated_requests_total)' || true
echo "$reply" | grep -q Paris || { echo "the container did not answer Paris" >&2; exit 1; }
# The server imported them at start (kvpolicy's CPU ops need them); this names the build it loaded.
docker exec "$name" python -c 'import kvpolicy_csrc._C as c; print("kvpolicy C++ ops:", c.__file__)'
echo "image check passed: the container answered through the OpenAI API"
