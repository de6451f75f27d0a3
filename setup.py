"""Ships ``kvpolicy-vllm-metadata.pth`` beside the packages (see _kvpolicy_distalias.py)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kvpolicy-vllm-metadata.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(Path(__file__).parent / "kvpolicy" / PTH), str(Path(self.build_lib) / PTH))


setup(cmdclass={"build_py": BuildWithPth})
