"""The ``--kv-*`` flags, each read from its option's field, and the tables the docs show of them.

The engine's options are ``KVPolicyConfig``'s fields; a policy's are its dataclass fields (its parts'
options). ``kvpolicy/vllm/startup/args.py`` builds the CLI from ``FLAGS``; docs/usage.md's options table and
docs/policies.md's composition table are generated here and checked by ``tests/unit/test_flags.py``:

    python -m kvpolicy.flags --write    # rewrite both tables from the source
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any

from kvpolicy.config import KVPolicyConfig, flag_default, policy_flags
from kvpolicy.policies import POLICIES, Policy
from kvpolicy.policies.compose import SameBudget, TokenSelector, UniformHeads
from kvpolicy.policies.options import is_option

#: Engine options shown after the policies' own.
_ENGINE_LAST = ("page_pool", "offload", "reserve_growth", "tp_allocation")
_KINDS = {"int": "int", "float": "float", "str": "str", "bool": "bool", "tuple[int, ...]": "layers"}
_METAVARS = {"int": "N", "float": "X", "bool": "true|false", "layers": "L,L,..."}
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Flag:
    """``--kv-<name>``: ``kind`` (int, float, str, bool or layers, a comma-separated list), ``default``
    (what a value equal to it means when no policy takes the flag: nothing), ``help``."""

    name: str
    kind: str
    default: Any
    help: str

    @property
    def option(self) -> str:
        return f"--kv-{self.name.replace('_', '-')}"

    @property
    def metavar(self) -> str:
        return _METAVARS.get(self.kind) or self.name.upper()


def _kind(f: Field) -> str:
    return _KINDS[str(f.type).removesuffix(" | None")]


def _shown(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _engine_flag(f: Field) -> Flag:
    default = "" if f.default is None else f" (default {_shown(f.default)})"
    return Flag(f.name, _kind(f), f.default, f.metadata["help"] + default)


def _policy_help(flag: str, takers: dict[str, Field]) -> str:
    """One sentence per help text: the policies it is theirs, what it does, their defaults."""
    by_help: dict[str, list[str]] = defaultdict(list)
    for name, f in takers.items():
        by_help[f.metadata["help"]].append(name)
    sentences = []
    for text, names in by_help.items():
        by_default: dict[Any, list[str]] = defaultdict(list)
        for name in names:
            by_default[takers[name].default].append(name)
        ranked = sorted(by_default.items(), key=lambda item: -len(item[1]))
        shown = [_shown(d) if i == 0 else f"{', '.join(n)} {_shown(d)}" for i, (d, n) in enumerate(ranked)]
        default = "" if ranked[0][0] is None and len(ranked) == 1 else f" (default {'; '.join(shown)})"
        sentences.append(f"{', '.join(names)}: {text}{default}")
    return ". ".join(sentences)


def _flags() -> list[Flag]:
    engine = {f.name: f for f in fields(KVPolicyConfig) if is_option(f)}
    takers: dict[str, dict[str, Field]] = defaultdict(dict)
    for name in POLICIES:
        for flag, f in policy_flags(name).items():
            takers[flag][name] = f
    first = [
        Flag("policy", "str", None, f"compression policy, one of: {', '.join(sorted(POLICIES))}"),
        *(_engine_flag(engine[name]) for name in engine if name not in _ENGINE_LAST),
    ]
    own = [
        Flag(flag, _kind(next(iter(fs.values()))), flag_default(flag), _policy_help(flag, fs))
        for flag, fs in takers.items()
    ]
    return [*first, *own, *(_engine_flag(engine[name]) for name in _ENGINE_LAST)]


#: Every ``--kv-*`` flag, in the order the CLI and docs/usage.md list them.
FLAGS: list[Flag] = _flags()


def _escaped(cell: str) -> str:
    """A Markdown table cell's text with its pipes escaped."""
    return cell.replace("|", "\\|")


def options_table() -> str:
    """docs/usage.md's table of flags."""
    rows = [f"| `{flag.option} {_escaped(flag.metavar)}` | {flag.help} |" for flag in FLAGS]
    return "\n".join(["| flag | what it sets |", "|---|---|", *rows])


def _part(part) -> str:
    options = [f.name for f in fields(part) if is_option(f)]
    return type(part).__name__ + (f" ({', '.join(options)})" if options else "")


def _applied(cls: type[Policy]) -> str:
    schedule = cls.schedule
    when = ["prompt end" if not schedule.across_layers else "prompt end, after the last layer"]
    when += ["every prompt chunk"] * schedule.per_chunk + ["each page filled in decode"] * schedule.in_decode
    return ", ".join(when)


def composition_table() -> str:
    """docs/policies.md's table: what each token-selecting policy is made of."""
    rows = []
    for name, cls in POLICIES.items():
        if not issubclass(cls, TokenSelector):
            continue
        parts = cls.parts
        layers = "" if isinstance(parts["layers"], SameBudget) else _part(parts["layers"])
        heads = "" if isinstance(parts["heads"], UniformHeads) else _part(parts["heads"])
        rewrite = "" if parts["rewrite"] is None else _part(parts["rewrite"])
        cells = [f"`{name}`", _part(parts["scorer"]), layers or "same budget", heads or "uniform", rewrite or "—"]
        rows.append(f"| {' | '.join(cells)} | {_applied(cls)} |")
    header = "| `--kv-policy` | scorer | layer allocator | head allocator | rewrite | applied at |"
    return "\n".join([header, "|---|---|---|---|---|---|", *rows])


#: file -> (marker, table): each table lies between ``<!-- marker -->`` and ``<!-- /marker -->``.
TABLES = {
    "docs/usage.md": ("kv-options", options_table),
    "docs/policies.md": ("kv-composition", composition_table),
}


def _block(marker: str) -> re.Pattern:
    return re.compile(rf"(<!-- {marker} -->\n)(.*?)(\n<!-- /{marker} -->)", re.S)


def table_in(path: Path, marker: str) -> str | None:
    found = _block(marker).search(path.read_text())
    return None if found is None else found.group(2)


def _with_table(text: str, marker: str, rows: str) -> tuple[str, int]:
    return _block(marker).subn(lambda m: m.group(1) + rows + m.group(3), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the tables in docs/usage.md and docs/policies.md")
    args = parser.parse_args()
    for name, (marker, table) in TABLES.items():
        path = ROOT / name
        if not args.write:
            print(f"{name}:\n{table()}\n")
            continue
        text, count = _with_table(path.read_text(), marker, table())
        if count != 1:
            raise SystemExit(f"{name}: no <!-- {marker} --> ... <!-- /{marker} --> block")
        path.write_text(text)


if __name__ == "__main__":
    main()
