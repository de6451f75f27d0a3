"""Imported by the forkserver of ``forked_runs.py``: work every forked engine run would otherwise repeat, done
once there and inherited by each fork.

vLLM's sampler ranks each sampled token with ``batched_count_greater_than``, a ``torch.compile`` function
(Inductor on CPU). Every ``engine_run.py`` run asks for logprobs, so each forked run used to trace and load it
anew: about 2.3 s of a tiny model's 5 s run (2026-11-28). Dynamo keeps what it compiled on the function's
code object, which a fork copies. The sampler's own ``gather_logprobs`` makes the call, as in a run (float32
logprobs over the vocabulary, inference mode); a run whose vocabulary differs compiles its own, as before.

A worker registers the platform's stand-ins for vLLM's Triton kernels (on CPU, C++ ones) when it starts, and
the registration scans every loaded module for references to rebind: 0.22 s of a tiny model's 0.75 s run
(2026-11-29). Registered here, after the modules a run uses are imported; a forked run then skips it
(``skip_inherited_registration``), and a worker spawned afresh (tensor and pipeline parallel ranks) registers
its own.
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
