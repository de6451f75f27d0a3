#!/usr/bin/env bash
# Serve the default model through vLLM's OpenAI-compatible server with a kvpolicy policy.
# Extra arguments go to `vllm serve` (e.g. --kv-policy none, --port 9000).
# Environment: KV_POLICY (default adaheavy, the best on the quality harness; see docs/benchmarks.md#quality;
# adamix where prompts share long prefixes: adaheavy never starts from a prefix-cache hit), KV_BUDGET (256), PORT (8000), VLLM_CPU_KVCACHE_SPACE (GiB, default 2).
set -euo pipefail
MODEL_DIR="$(kvpolicy-model)"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
exec vllm serve "$MODEL_DIR" \
  --served-model-name SmolLM2-135M-Instruct \
  --dtype float32 \
  --max-model-len 8192 \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \
  --kv-policy "${KV_POLICY:-adaheavy}" --kv-budget "${KV_BUDGET:-256}" \
  "$@"
