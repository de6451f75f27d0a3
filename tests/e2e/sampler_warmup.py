"""Imported by the forkserver of ``forked_runs.py``: compiles vLLM's logprob rank kernel once, so that every
forked engine run inherits it instead of compiling it again.

vLLM's sampler ranks each sampled token with ``batched_count_greater_than``, a ``torch.compile`` function
(Inductor on CPU). Every ``engine_run.py`` run asks for logprobs, so each forked run used to trace and load it
anew: about 2.3 s of a tiny model's 5 s run (2026-11-28). Dynamo keeps what it compiled on the function's
code object, which a fork copies. The sampler's own ``gather_logprobs`` makes the call, as in a run (float32
logprobs over the vocabulary, inference mode); a run whose vocabulary differs compiles its own, as before.
"""

import torch
import torch._inductor.config
from vllm.v1.sample.sampler import Sampler

#: The vocabulary of the default model and of the tiny models made from its tokenizer.
VOCAB = 49152

torch._inductor.config.compile_threads = 1  # no pool of compile workers in a process that others fork from
with torch.inference_mode():
    Sampler.gather_logprobs(torch.zeros(2, VOCAB), 1, torch.zeros(2, dtype=torch.int64))
