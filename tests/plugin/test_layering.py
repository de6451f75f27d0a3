"""DESIGN §2: policies/ and paging/ import no vLLM; only kvpolicy.vllm does."""

import subprocess
import sys


def test_pure_layers_do_not_import_vllm():
    code = (
        "import sys, kvpolicy, kvpolicy.config, kvpolicy.policies, kvpolicy.paging, kvpolicy.model, kvpolicy.calibrate;"
        "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
