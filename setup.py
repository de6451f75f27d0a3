"""Ships ``kvpolicy-vllm-metadata.pth`` beside the packages (see _kvpolicy_distalias.py), and the
top-level ``triton_kernels/`` directory as the package ``kvpolicy_triton``."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "kvpolicy-vllm-metadata.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(Path(__file__).parent / "kvpolicy" / PTH), str(Path(self.build_lib) / PTH))


setup(
    cmdclass={"build_py": BuildWithPth},
    packages=[*find_packages(include=["kvpolicy*"]), "kvpolicy_triton"],
    package_dir={"kvpolicy_triton": "triton_kernels"},
    package_data={"kvpolicy": ["data/*.json"]},
)
