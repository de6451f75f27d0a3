"""The layering of docs/architecture.md: policies/ and paging/ import no vLLM; only kvpolicy.vllm does.

The Triton kernels and the C++ ops stand alone.
"""

import subprocess
import sys


def _modules_after(imports: str) -> set[str]:
    code = f"import sys, {imports}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_pure_layers_do_not_import_vllm():
    loaded = _modules_after(
        "kvpolicy, kvpolicy.config, kvpolicy.policies, kvpolicy.paging, kvpolicy.model, kvpolicy.calibrate, kvpolicy.calibrate_pod, kvpolicy.train_pod"
    )
    assert not any(m == "vllm" or m.startswith("vllm.") for m in loaded)


def test_kernels_import_neither_vllm_nor_kvpolicy():
    for package in ("kvpolicy_triton", "kvpolicy_csrc"):
        loaded = _modules_after(package)
        assert not any(m.split(".")[0] in ("vllm", "kvpolicy") for m in loaded), package
