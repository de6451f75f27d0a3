"""A request's ``vllm_xargs`` reach kvpolicy's checks as the JSON said: ``true`` stays a boolean (vLLM's field
type would make it 1), so ``kv_budget: true`` is refused as a boolean, not as a budget of one token."""

import importlib
import json

import pytest

from kvpolicy.config import KVPolicyConfig, KVPolicyConfigError
from kvpolicy.vllm.internals import XARGS_REQUEST_MODELS
from kvpolicy.vllm.patches import keep_request_booleans
from kvpolicy.vllm.startup.plugin import register

BODIES = {
    "CompletionRequest": {"model": "m", "prompt": "Hello"},
    "ChatCompletionRequest": {"model": "m", "messages": [{"role": "user", "content": "Hello"}]},
    "ResponsesRequest": {"model": "m", "input": "Hello"},
}


@pytest.mark.parametrize("module, name", XARGS_REQUEST_MODELS, ids=[name for _, name in XARGS_REQUEST_MODELS])
def test_json_true_stays_a_boolean_and_numbers_stay_numbers(module, name):
    register()
    keep_request_booleans(XARGS_REQUEST_MODELS)  # a second call changes nothing
    model = getattr(importlib.import_module(module), name)
    xargs = {"kv_budget": True, "kv_policy": "snapkv", "n": 3, "x": 1.5, "s": "2", "l": [1, False]}
    request = model.model_validate_json(json.dumps({**BODIES[name], "vllm_xargs": xargs}))
    assert request.vllm_xargs == xargs
    assert [type(v) for v in request.vllm_xargs.values()] == [bool, str, int, float, str, list]
    with pytest.raises(KVPolicyConfigError, match="kv_budget is a number of tokens per KV head, not a boolean"):
        KVPolicyConfig(policy="adasnap", budget=256).check_request_options(
            {k: v for k, v in request.vllm_xargs.items() if k.startswith("kv_")}, 4096
        )
