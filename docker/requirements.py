"""Print kvpolicy's dependencies and those of the extras named on the command line, one a line.

Read from pyproject.toml alone, so the image (Dockerfile) installs them in a layer below the
sources: a change to kvpolicy's code does not reinstall vLLM and torch.

    python docker/requirements.py cpu model > requirements.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project["optional-dependencies"]
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"no such extra in pyproject.toml: {', '.join(unknown)} (choose from {', '.join(optional)})")
    return [*project["dependencies"], *(req for name in extras for req in optional[name])]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
