#!/usr/bin/env bash
# avx2.sh COMMAND...: run COMMAND as on an x86 CPU without AVX-512, on one that has it.
#
# Every Python process COMMAND starts imports sitecustomize.py from here, so torch answers no AVX-512 and vLLM loads
# its AVX2 build; the variables below make ATen, oneDNN, MKL, OpenBLAS and NumPy dispatch AVX2 code. What the
# instruction set costs, not an older core's speed (cpu_share.sh adds that). `make test-avx2` and
# benchmarks/emulated_cpu.py use it.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: avx2.sh COMMAND..." >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
export KVPOLICY_EMULATE_AVX2=1
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OPENBLAS_CORETYPE=Haswell
export NPY_DISABLE_CPU_FEATURES="AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
exec "$@"
