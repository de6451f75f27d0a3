"""The repository stands alone: no file points outside it, and the docs' relative links resolve.

Papers are cited by title and arXiv id, never by the file names of local copies; links in
README.md and docs/*.md must reach a file in the repository and, for `file.md#anchor`, a heading
of that file (GitHub's anchors: lower case, punctuation dropped, spaces to dashes).
"""

import re
import subprocess
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
#: Built from parts so that this file does not match itself.
OUTSIDE_PATH = "../" + "shared"
PAPER_FILES = tuple(f"{stem}.txt" for stem in ("adakv", "d2o", "keydiff", "omnikv", "pod"))
DESIGN_BRIEF = "DESIGN" + ".md"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    names = [name for name in out.stdout.decode().split("\0") if name]
    return [ROOT / name for name in names if (ROOT / name).is_file()]


def _markdown_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    text = INLINE_CODE.sub(lambda m: m.group(0)[1:-1], heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    anchors = set()
    for line in _markdown_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        anchors.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def _links(path: Path) -> list[str]:
    return [m.group(1) for line in _markdown_lines(path) for m in LINK.finditer(INLINE_CODE.sub("", line))]


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_tracked_file_points_outside_the_repository():
    needles = [OUTSIDE_PATH, *PAPER_FILES, DESIGN_BRIEF]
    offenders = []
    for path in _tracked_files():
        text = path.read_bytes().decode("utf-8", errors="ignore")
        offenders += [f"{path.relative_to(ROOT)}: {needle}" for needle in needles if needle in text]
    assert not offenders, "cite papers by title and arXiv id; nothing outside the repository:\n" + "\n".join(offenders)


def test_relative_markdown_links_resolve():
    broken = []
    for doc in _docs():
        for link in _links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", link):
                continue
            target, _, anchor = unquote(link).partition("#")
            path = (doc.parent / target).resolve() if target else doc
            where = f"{doc.relative_to(ROOT)}: {link}"
            if not path.is_relative_to(ROOT):
                broken.append(f"{where} (outside the repository)")
            elif not path.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_benchmarks_put_the_repository_after_installed_packages_on_the_path():
    """A benchmark imports kvpolicy as installed: prepended, the tree's ``triton_kernels/`` would shadow
    OpenAI's package of that name, which vLLM imports for MoE models."""
    prepending = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "benchmarks").rglob("*.py"))
        if re.search(r"sys\.path\.insert\(\s*0", path.read_text())
    ]
    assert not prepending, prepending
