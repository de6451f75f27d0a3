"""The user's compression settings: one typed record, validated once, shared by all processes."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

from kvpolicy.policies import POLICIES, Mode, Policy, make_policy
from kvpolicy.policies.options import check_value, flag_of, is_option, not_negative, one_of, option

#: Options a request may set in ``SamplingParams.extra_args`` (OpenAI API: ``vllm_xargs``).
REQUEST_BUDGET_KEY = "kv_budget"
REQUEST_POLICY_KEY = "kv_policy"
REQUEST_DECODE_BUFFER_KEY = "kv_decode_buffer"
REQUEST_OPTIONS = (REQUEST_BUDGET_KEY, REQUEST_POLICY_KEY, REQUEST_DECODE_BUFFER_KEY)


class KVPolicyConfigError(ValueError):
    """A setting that cannot be served; the message says what to change."""


def check_policy_name(name: str) -> None:
    if name not in POLICIES:
        raise KVPolicyConfigError(f"unknown --kv-policy {name!r}; choose one of: " + ", ".join(sorted(POLICIES)))


def _budget(value) -> str | None:
    return None if value > 0 else f"must be a positive number of tokens per KV head, got {value}"


def _ratio(value) -> str | None:
    return None if 0.0 < value <= 1.0 else f"is the fraction of prompt tokens kept, in (0, 1]; got {value}"


def _pool_size(value) -> str | None:
    return None if value > 0 else f"is the host pool's size in GiB, > 0; got {value}"


def policy_option_fields(name: str) -> dict[str, Field]:
    """The options of policy ``name``, by field name."""
    return {f.name: f for f in fields(POLICIES[name]) if is_option(f)}


def policy_flags(name: str) -> dict[str, Field]:
    """The options of policy ``name`` that a ``--kv-*`` flag sets, by flag name."""
    return {flag_of(f): f for f in policy_option_fields(name).values() if flag_of(f) is not None}


def flag_default(flag: str):
    """The default of ``--kv-<flag>``: what every policy that takes it defaults to, or None."""
    defaults = {f.default for name in POLICIES for fl, f in policy_flags(name).items() if fl == flag}
    return defaults.pop() if len(defaults) == 1 else None


def flag_takers(flag: str) -> list[str]:
    return sorted(name for name in POLICIES if flag in policy_flags(name))


def _misplaced(flag: str, policy: str) -> str:
    """Why ``--kv-<flag>`` is refused with ``--kv-policy policy``. Flags named after their one policy
    (``--kv-pod-*``) are named together."""
    takers = flag_takers(flag)
    own = f"{takers[0]}_"
    if len(takers) == 1 and flag.startswith(own):
        named = [f"--kv-{f.replace('_', '-')}" for f in policy_flags(takers[0]) if f.startswith(own)]
        return f"{' and '.join(named)} apply to --kv-policy {takers[0]}, not {policy}"
    return f"--kv-{flag.replace('_', '-')} applies to {', '.join(takers)}, not to --kv-policy {policy}"


def check_flag(flag: str, value) -> None:
    """Refuse a bad value of ``--kv-<flag>`` on its own (before the other options are known)."""
    if flag == "policy":
        return check_policy_name(value)
    engine = {f.name: f for f in fields(KVPolicyConfig) if is_option(f)}
    takers = [policy_flags(name)[flag] for name in flag_takers(flag)]
    problem = _option_problem(flag, engine[flag] if flag in engine else takers[0], value)
    if problem:
        raise KVPolicyConfigError(problem)


#: What an option of each number type takes. Python counts a bool as an int (and JSON's true as 1), so a
#: boolean would pass every range check as 0 or 1: it is refused by name instead.
_NUMBERS = {"int": "an integer", "float": "a number", "tuple[int, ...]": "layer indices"}


def _option_problem(flag: str, f: Field, value) -> str | None:
    """What is wrong with ``--kv-<flag> value`` (a boolean where the option is a number, or the option's
    own check), or None."""
    kind = str(f.type).removesuffix(" | None")
    items = value if isinstance(value, (tuple, list)) else (value,)
    if kind in _NUMBERS and any(isinstance(item, bool) for item in items):
        return f"--kv-{flag.replace('_', '-')} takes {_NUMBERS[kind]}, not a boolean (got {value!r})"
    return check_value(flag, f, value)


def _as_field_type(f: Field, value):
    """A value as the field holds it (a JSON list back to a tuple)."""
    return tuple(value) if isinstance(f.default, tuple) and value is not None else value


@dataclass(frozen=True, init=False)
class KVPolicyConfig:
    """Options of ``--kv-*`` flags, carried to every process in ``additional_config``.

    The engine's own options are fields here; the policy's are in ``options``, by the policy's field
    names, only those given (the policy's dataclass holds their defaults and help).
    """

    policy: str = "none"
    budget: int | None = option(
        None, "tokens kept per KV head after the prompt; must be at most --max-model-len", check=_budget
    )
    ratio: float | None = option(None, "fraction of prompt tokens kept, instead of a budget", check=_ratio)
    decode_buffer: int | None = option(
        None,
        "relocating policies: a prompt shorter than --kv-budget is compressed once decode takes its cache past the "
        "budget; the SnapKV family and streaming then let it grow this many tokens past the budget (rounded up to "
        "whole pages) between passes (keydiff, h2o, d2o evict at every page over it); 0 keeps such requests whole "
        "(default: one page)",
        check=not_negative,
        mode=Mode.RELOCATE,
    )
    page_pool: str | None = option(
        None,
        "relocating policies: model (the CPU default) pools a request's pages over every layer of its blocks, so a "
        "layer that keeps more borrows the others' pages; layer packs each layer into its own part of the blocks "
        "(the only choice on CUDA, where model is refused)",
        check=one_of("model", "layer"),
        mode=Mode.RELOCATE,
    )
    offload: float | None = option(
        None,
        "omnikv: the sparse layers' KV lives in a separate host pool of this many GiB; vLLM's pool keeps the "
        "full-attention layers and what each step loads, and the request hands the rest of its blocks back",
        check=_pool_size,
        mode=Mode.SELECT,
    )
    reserve_growth: bool = option(
        True,
        "admit a request only if the blocks compressed requests will still grow by (up to their max_tokens) stay "
        "free besides, so they are not preempted (false: vLLM's admission by prompt)",
    )
    tp_allocation: str = option(
        "exact",
        "with --tensor-parallel-size: exact (Ada-KV's layer-wide allocation over every rank's heads, gathered: "
        "the kept tokens of one GPU) or rank (each rank allocates over its own heads, no collective)",
        check=one_of("exact", "rank"),
    )
    options: Mapping[str, Any] = field(default_factory=dict)

    ADDITIONAL_CONFIG_KEY = "kv_policy"

    def __init__(self, policy: str = "none", options: Mapping[str, Any] | None = None, **values) -> None:
        """``values``: the engine's options by field name, and the policy's by ``--kv-*`` name
        (``window=64``, ``pod_tau=0.7``) as the CLI and ``LLM(kv_*=...)`` give them; ``options``: the
        policy's by field name. A policy's option another policy takes is dropped, or refused when strict."""
        check_policy_name(policy)
        object.__setattr__(self, "policy", policy)
        for f in fields(self):
            if is_option(f):
                value = values.pop(f.name, f.default)
                problem = _option_problem(f.name, f, value)
                if problem:
                    raise KVPolicyConfigError(problem)
                object.__setattr__(self, f.name, value)
        object.__setattr__(self, "options", self._policy_options(dict(options or {}), values))
        self._check()

    def _policy_options(self, given: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
        """The policy's options by field name from ``given`` (by field name) and ``flags`` (by flag)."""
        every_flag = {fl: f for name in POLICIES for fl, f in policy_flags(name).items()}
        unknown = sorted(set(flags) - set(every_flag))
        if unknown:
            raise KVPolicyConfigError(f"unknown kv_policy options: {unknown}")
        takes, by_flag = policy_option_fields(self.policy), policy_flags(self.policy)
        for flag, value in flags.items():
            f = by_flag.get(flag, every_flag[flag])
            problem = _option_problem(flag, f, value)
            if problem:
                raise KVPolicyConfigError(problem)
            if flag in by_flag and value is not None:
                given[f.name] = value
            elif f.metadata["strict"] and value is not None and value != flag_default(flag):
                raise KVPolicyConfigError(_misplaced(flag, self.policy))
        for name, value in given.items():
            if name not in takes:
                raise KVPolicyConfigError(f"--kv-policy {self.policy} has no option {name!r}")
            problem = _option_problem(flag_of(takes[name]) or name, takes[name], value)
            if problem:
                raise KVPolicyConfigError(problem)
        return {name: _as_field_type(takes[name], value) for name, value in given.items()}

    def _check(self) -> None:
        """What no single option says: combinations."""
        if self.budget is not None and self.ratio is not None:
            raise KVPolicyConfigError("give --kv-budget or --kv-ratio, not both")
        policy = POLICIES[self.policy]
        for f in fields(self):
            mode = f.metadata.get("mode")
            if mode is not None and getattr(self, f.name) is not None and policy.mode is not mode:
                takers = sorted(name for name, cls in POLICIES.items() if cls.mode is mode)
                raise KVPolicyConfigError(
                    f"--kv-{flag_of(f).replace('_', '-')} applies to --kv-policy {', '.join(takers)}, not {self.policy}"
                )
        if policy.needs_budget and self.budget is None and self.ratio is None:
            raise KVPolicyConfigError(f"--kv-policy {self.policy} needs --kv-budget or --kv-ratio")
        window = self.observation_window
        if window is not None and self.budget is not None and self.budget <= window:
            raise KVPolicyConfigError(
                f"--kv-budget {self.budget} must be larger than the observation window "
                f"--kv-window {window}, which {self.policy} always keeps"
            )

    @functools.cached_property
    def selected(self) -> Policy:
        """The policy these options make (made once)."""
        return self.make_policy()

    @property
    def observation_window(self) -> int | None:
        """The window a window-scored policy always keeps (``--kv-window``); None for other policies."""
        return self.selected.window if self.selected.inputs.window else None

    def for_policy(self, name: str) -> KVPolicyConfig:
        """These options for policy ``name`` (a request's ``kv_policy``): the engine's, and the policy
        options ``name`` takes."""
        takes = policy_option_fields(name)
        engine = {f.name: getattr(self, f.name) for f in fields(self) if is_option(f)}
        return KVPolicyConfig(name, {k: v for k, v in self.options.items() if k in takes}, **engine)

    def flags(self) -> dict[str, Any]:
        """Every ``--kv-*`` value these options stand for, by flag name, defaults included."""
        engine = {f.name: getattr(self, f.name) for f in fields(self) if is_option(f)}
        policy = {flag: getattr(self.selected, f.name) for flag, f in policy_flags(self.policy).items()}
        return {"policy": self.policy, **engine, **policy}

    @property
    def compresses(self) -> bool:
        """Whether requests leave vLLM's stock layout (anything but ``none`` and ``omnikv``)."""
        return POLICIES[self.policy].mode.traits.frees_blocks

    @property
    def rewrites_blocks(self) -> bool:
        """Whether vLLM blocks may hold something else than their tokens: relocation or offload."""
        return self.compresses or self.offload is not None

    @property
    def pools_every_layer(self) -> bool:
        """Whether a request's pages may lie in any layer's part of vLLM's KV buffer (the worker's page
        space): PoD, ``--kv-offload``, ``--kv-page-pool model``."""
        return (
            POLICIES[self.policy].mode.traits.pools_every_layer or self.offload is not None or self.page_pool == "model"
        )

    @property
    def changes_attention(self) -> bool:
        """Whether some request attends to anything but vLLM's stock cache (anything but ``none``)."""
        return POLICIES[self.policy].mode.traits.changes_attention

    @property
    def moves_after_prompt(self) -> bool:
        """Whether a request's pages may move after its prompt is read: PoD's layout, an offload (which a
        recompute past the prompt after a preemption ends), a prompt within its budget that decode takes past it."""
        policy = POLICIES[self.policy]
        return policy.mode.traits.moves_after_prompt or self.offload is not None or self.compresses_in_decode

    @property
    def compresses_in_decode(self) -> bool:
        """Whether a prompt within its budget may be compressed once decode takes it past it (``decode_budget``):
        a relocating policy with a budget, unless ``--kv-decode-buffer 0``."""
        policy = POLICIES[self.policy]
        return policy.mode is Mode.RELOCATE and policy.needs_budget and self.decode_buffer != 0

    def sparse_budget(self, context_len: int, num_layers: int, override: int | None = None) -> int:
        """OmniKV: tokens a sparse layer attends to at this context length (``--kv-ratio`` is Mem%)."""
        if override is not None:
            return override
        if self.budget is not None:
            return self.budget
        try:
            return self.make_policy().sparse_budget(self.ratio, context_len, num_layers)
        except ValueError as exc:
            raise KVPolicyConfigError(str(exc)) from None

    def budget_for(self, prompt_len: int, override: int | None = None) -> int | None:
        """Tokens per KV head kept from a prompt of ``prompt_len``; None keeps the prompt whole.

        ``override`` is a request's own ``kv_budget`` (already validated).
        """
        budget = self._budget(prompt_len, override)
        return budget if budget is not None and budget < prompt_len else None

    def decode_budget(self, prompt_len: int, override: int | None = None) -> int | None:
        """Tokens per KV head a prompt of ``prompt_len`` within its ``--kv-budget`` (or ``kv_budget``) is
        brought back to once decode takes it past them; None when its prompt is compressed at its end, or
        no budget is set in tokens (``--kv-ratio`` compresses every prompt at its end)."""
        if override is None and self.budget is None:
            return None
        budget = self._budget(prompt_len, override)
        return budget if budget >= prompt_len else None

    def _budget(self, prompt_len: int, override: int | None) -> int | None:
        if override is not None:
            budget = override
        elif self.budget is not None:
            budget = self.budget
        elif self.ratio is not None:
            budget = max(1, round(self.ratio * prompt_len))
        else:
            return None
        if self.observation_window is not None:
            budget = max(budget, self.observation_window + 1)
        return budget

    def request_policies(self) -> list[str]:
        """What a request's ``kv_policy`` may name on this server: ``none`` (it stays on vLLM's stock
        path) and the server's policy family (policies that differ only in which tokens they keep)."""
        family = POLICIES[self.policy].family()
        same = sorted(name for name, cls in POLICIES.items() if cls.family() == family and name != "none")
        return ["none", *same]

    def check_request_options(self, extra_args: dict, max_model_len: int) -> dict:
        """A request's ``kv_*`` options (``vllm_xargs``), checked; other keys belong to others and are left."""
        options = {key: value for key, value in extra_args.items() if key.startswith("kv_")}
        unknown = sorted(set(options) - set(REQUEST_OPTIONS))
        if unknown:
            raise KVPolicyConfigError(
                f"unknown request option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"kvpolicy takes {', '.join(REQUEST_OPTIONS)} per request"
            )
        policy = options.get(REQUEST_POLICY_KEY, self.policy)
        if REQUEST_POLICY_KEY in options:
            allowed = self.request_policies()
            if not isinstance(policy, str) or policy not in allowed:
                raise KVPolicyConfigError(
                    f"kv_policy {policy!r} cannot be served by this server (--kv-policy {self.policy}): a request "
                    f"may ask for {', '.join(allowed)}; other policies read different inputs or change the "
                    "scheduler's accounting, so they need a server started with them"
                )
        if REQUEST_BUDGET_KEY in options:
            if policy == "none":
                raise KVPolicyConfigError("kv_budget does not apply to a request with kv_policy 'none'")
            self.check_request_budget(options[REQUEST_BUDGET_KEY], max_model_len)
        if REQUEST_DECODE_BUFFER_KEY in options:
            self.check_request_decode_buffer(options[REQUEST_DECODE_BUFFER_KEY], policy, max_model_len)
        return options

    def check_request_decode_buffer(self, value, policy: str, max_model_len: int) -> int:
        """A per-request ``kv_decode_buffer`` (``vllm_xargs``): an int in [0, max_model_len], for a request
        a relocating policy compresses (``--kv-decode-buffer``)."""
        if policy == "none" or POLICIES[policy].mode is not Mode.RELOCATE or not POLICIES[policy].needs_budget:
            raise KVPolicyConfigError(
                f"kv_decode_buffer applies to relocating policies with a budget, not kv_policy {policy!r}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max_model_len:
            raise KVPolicyConfigError(
                f"kv_decode_buffer must be an integer number of tokens in [0, {max_model_len}], got {value!r}"
            )
        if value and not self.compresses_in_decode:
            raise KVPolicyConfigError(
                "kv_decode_buffer > 0 needs a server that compresses in decode (started without --kv-decode-buffer 0)"
            )
        return value

    def check_request_budget(self, value, max_model_len: int) -> int:
        """A per-request ``kv_budget`` (``vllm_xargs``): an int in (window, max_model_len]."""
        if not self.changes_attention or not POLICIES[self.policy].needs_budget:
            raise KVPolicyConfigError(
                f"kv_budget applies to compressing policies; this server runs --kv-policy {self.policy}"
            )
        if isinstance(value, bool):
            raise KVPolicyConfigError(
                f"kv_budget is a number of tokens per KV head, not a boolean (got {str(value).lower()}); "
                "give an integer, such as 256"
            )
        if not isinstance(value, int) or value <= 0:
            raise KVPolicyConfigError(f"kv_budget must be a positive integer number of tokens, got {value!r}")
        if value > max_model_len:
            raise KVPolicyConfigError(f"kv_budget {value} is larger than the context limit {max_model_len}")
        if POLICIES[self.policy].schedule.per_chunk and self.budget is not None and value > self.budget:
            raise KVPolicyConfigError(
                f"kv_budget {value} is larger than --kv-budget {self.budget}, which sized the KV pool "
                f"for {self.policy} requests; ask for at most {self.budget}"
            )
        if self.observation_window is not None and value <= self.observation_window:
            raise KVPolicyConfigError(
                f"kv_budget {value} must be larger than the observation window ({self.observation_window} tokens)"
            )
        return value

    def make_policy(self) -> Policy:
        """The policy with these options; options not given keep the policy's own defaults."""
        return make_policy(self.policy, **self.options)

    def check_model_len(self, max_model_len: int) -> None:
        if self.budget is not None and self.budget > max_model_len:
            raise KVPolicyConfigError(
                f"--kv-budget {self.budget} is larger than --max-model-len {max_model_len}: "
                "no prompt could be compressed; lower the budget or raise --max-model-len"
            )

    def to_dict(self) -> dict:
        return {
            f.name: dict(getattr(self, f.name)) if f.name == "options" else getattr(self, f.name) for f in fields(self)
        }

    @classmethod
    def from_dict(cls, values: dict | None) -> KVPolicyConfig:
        values = values or {}
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise KVPolicyConfigError(f"unknown kv_policy options: {sorted(unknown)}")
        return cls(**values)

    @classmethod
    def stored_in(cls, additional_config: dict | None) -> KVPolicyConfig | None:
        """The config start-up stored in vLLM's ``additional_config`` (which vLLM copies to every process);
        None when no policy was asked for."""
        values = (additional_config or {}).get(cls.ADDITIONAL_CONFIG_KEY)
        return None if values is None else cls.from_dict(values)
