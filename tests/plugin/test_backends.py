"""The CPU and CUDA backends are siblings: one step builder, one dispatch mixin, their platform's classes below.

The CUDA backend cannot run here; what can be checked without a GPU is
checked: it imports beside vLLM's Triton backend, keeps its name, mixes in
the same dispatch, and reports to vLLM's CUDA-graph resolution that attention
runs outside graphs only while a policy changes attention.
"""

from types import SimpleNamespace

import pytest

from kvpolicy.config import KVPolicyConfig
from kvpolicy.vllm import cpu_backend, cuda_backend
from kvpolicy.vllm.attention import KVPolicyAttention
from kvpolicy.vllm.internals import AttentionCGSupport


@pytest.mark.parametrize(
    "backend, name", [(cpu_backend.KVPolicyCPUBackend, "CPU_ATTN"), (cuda_backend.KVPolicyTritonBackend, "TRITON_ATTN")]
)
def test_each_backend_keeps_its_platform_name_and_mixes_in_the_dispatch(backend, name):
    assert backend.get_name() == name
    impl = backend.get_impl_cls()
    assert impl.__mro__[1] is KVPolicyAttention
    assert impl.__mro__[2] is backend.__mro__[1].get_impl_cls()
    assert backend.get_builder_cls().__mro__[1] is backend.__mro__[1].get_builder_cls()


def test_cuda_builder_gives_up_cuda_graphs_for_attention_only_while_a_policy_changes_it():
    builder = cuda_backend.KVPolicyTritonBackend.get_builder_cls()
    stock = builder.__mro__[1].get_cudagraph_support(None, None)

    def support(policy):
        extra = {} if policy is None else {KVPolicyConfig.ADDITIONAL_CONFIG_KEY: KVPolicyConfig(policy=policy, budget=256).to_dict()}
        return builder.get_cudagraph_support(SimpleNamespace(additional_config=extra), None)

    assert support(None) == support("none") == stock
    assert support("adasnap") == AttentionCGSupport.NEVER
