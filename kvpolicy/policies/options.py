"""Options declared once: a dataclass field with its help, its ``--kv-*`` flag and its check.

A policy's options are the fields of its parts (scorer, allocators, rewrite) or of its own class; the
CLI (``kvpolicy/vllm/startup/args.py``), docs/usage.md's options table and ``KVPolicyConfig``'s checks are all read
from these fields (``tests/unit/test_flags.py`` fails when that table drifts from them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, field
from pathlib import Path
from typing import Any

#: A check: None when the value is fine, else what is wrong with it, after the flag's name.
Check = Callable[[Any], "str | None"]


def option(
    default: Any, help: str, *, flag: str | None = "", check: Check | None = None, strict: bool = True, mode=None
):
    """A dataclass field that is an option.

    ``flag``: the ``--kv-*`` name without the prefix, in snake case ("" for the field's own name,
    None when no flag sets it). ``strict``: a value other than the flag's default given with a policy
    that does not take it is refused; otherwise it is ignored (flags several policies read their own way,
    such as ``--kv-window``, are not strict). ``mode``: an engine option that only policies of this
    ``Mode`` take (given with another, it is refused).
    """
    return field(default=default, metadata={"help": help, "flag": flag, "check": check, "strict": strict, "mode": mode})


def is_option(f: Field) -> bool:
    return "help" in f.metadata


def flag_of(f: Field) -> str | None:
    """The option's flag name (``pod_tau`` for ``--kv-pod-tau``), or None when no flag sets it."""
    flag = f.metadata["flag"]
    return f.name if flag == "" else flag


def check_value(flag: str, f: Field, value: Any) -> str | None:
    """The error for ``--kv-<flag> value``, or None."""
    check = f.metadata["check"]
    problem = None if check is None or value is None else check(value)
    return None if problem is None else f"--kv-{flag.replace('_', '-')} {problem}"


def positive(value) -> str | None:
    return None if value > 0 else f"must be positive, got {value}"


def not_negative(value) -> str | None:
    return None if value >= 0 else f"must be >= 0, got {value}"


def positive_odd(value) -> str | None:
    return None if value > 0 and value % 2 else f"must be a positive odd number, got {value}"


def unit_interval(value) -> str | None:
    return None if 0.0 <= value <= 1.0 else f"must be in [0, 1], got {value}"


def one_of(*choices: str) -> Check:
    def check(value) -> str | None:
        return None if value in choices else f"is {' or '.join(choices)}, got {value!r}"

    return check


def increasing_layers(value) -> str | None:
    ordered = bool(value) and sorted(set(value)) == list(value)
    return None if ordered else f"must be distinct layer indices in increasing order, got {tuple(value)}"


def gate_threshold(value) -> str | None:
    return None if 0.0 <= value <= 1.0 else f"is a gate threshold in [0, 1], got {value}"


def existing_grouping(value) -> str | None:
    if Path(value).is_file():
        return None
    return f"{value}: no such file; make one with `python -m kvpolicy.offline.calibrate_pod --model MODEL --out PATH`"
