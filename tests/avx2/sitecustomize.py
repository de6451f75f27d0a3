"""``make test-avx2``: every Python process of the suite (test workers, forked engine runs, ``vllm serve``) runs
as on an x86 CPU without AVX-512.

On ``PYTHONPATH`` this module is imported at interpreter start. torch's ISA probes then answer no AVX-512, so
vLLM loads its AVX2 build (``vllm._C_AVX2``) and picks its AVX2 paths; ``avx2.sh``'s variables make ATen,
oneDNN, MKL, OpenBLAS and NumPy dispatch AVX2 code. kvpolicy's own C++ ops stay built for the machine
(``-march=native``). It measures what the instruction set costs, not an older core's speed.
"""

import os

if os.environ.get("KVPOLICY_EMULATE_AVX2") == "1":
    import torch.cpu

    for probe in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        setattr(torch.cpu, probe, lambda: False)
