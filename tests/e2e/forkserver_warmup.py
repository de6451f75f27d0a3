"""Imported by the forkserver of ``forked_runs.py``: work every forked engine run would otherwise repeat, done
once there and inherited by each fork.

It compiles vLLM's sampler's ``batched_count_greater_than`` (``torch.compile``) through the sampler's own
``gather_logprobs``, as a run calls it, since Dynamo keeps what it compiled on the code object a fork copies (a run
whose vocabulary differs compiles its own); and it registers the platform's stand-ins for vLLM's Triton kernels after
the modules a run uses are imported, so a forked run skips that scan (``skip_inherited_registration``) and a worker
spawned afresh registers its own. The time each saves: docs/benchmarks.md#how-engine-runs-stay-deterministic-and-cheap.
"""

import warnings

import torch
import torch._inductor.config
from vllm.platforms import current_platform
from vllm.v1.sample.sampler import Sampler

#: The vocabulary of the default model and of the tiny models made from its tokenizer.
VOCAB = 49152

torch._inductor.config.compile_threads = 1  # no pool of compile workers in a process that others fork from
with torch.inference_mode():
    Sampler.gather_logprobs(torch.zeros(2, VOCAB), 1, torch.zeros(2, dtype=torch.int64))

with warnings.catch_warnings():  # the scan reads torch.distributed's deprecated names, which warn
    warnings.simplefilter("ignore", FutureWarning)
    current_platform.register_triton_kernel_overrides()


def skip_inherited_registration() -> None:
    """In a forked process: the worker's registration is a no-op (a second one would wrap the stand-ins)."""
    type(current_platform).register_triton_kernel_overrides = classmethod(lambda cls: None)
