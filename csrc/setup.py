"""Builds kvpolicy's C++ CPU ops as ``kvpolicy_csrc`` against the torch in this environment.

Installed by ``make install`` as ``pip install --no-build-isolation ./csrc`` (the
extension must match the installed torch, so it builds against it, not an isolated copy).
"""

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).parent
# -ffast-math with -fopenmp-simd lets GCC call glibc's vector expf (libmvec) in the softmax loops;
# -march=native: the extension is built on the machine that runs it.
COMPILE_ARGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]

setup(
    name="kvpolicy-csrc",
    version="0.1.0",
    packages=["kvpolicy_csrc"],
    ext_modules=[
        CppExtension(
            "kvpolicy_csrc._C",
            sorted(str(p.relative_to(HERE)) for p in HERE.glob("*.cpp")),
            extra_compile_args=COMPILE_ARGS,
            extra_link_args=["-lmvec"],
            depends=[str(p.relative_to(HERE)) for p in HERE.glob("*.h")],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
