"""The user's compression settings: one typed record, validated once, shared by all processes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kvpolicy.policies import POLICIES, Mode, make_policy

#: OmniKV defaults for the default model (30 layers), from ``python -m kvpolicy.calibrate`` (docs/policies.md).
OMNIKV_FILTER_LAYERS = (2, 9, 15)
OMNIKV_DENSE_LAYERS = 2


#: Options a request may set in ``SamplingParams.extra_args`` (OpenAI API: ``vllm_xargs``).
REQUEST_BUDGET_KEY = "kv_budget"
REQUEST_POLICY_KEY = "kv_policy"
REQUEST_OPTIONS = (REQUEST_BUDGET_KEY, REQUEST_POLICY_KEY)


class KVPolicyConfigError(ValueError):
    """A setting that cannot be served; the message says what to change."""


def check_policy_name(name: str) -> None:
    if name not in POLICIES:
        raise KVPolicyConfigError(f"unknown --kv-policy {name!r}; choose one of: " + ", ".join(sorted(POLICIES)))


@dataclass(frozen=True)
class KVPolicyConfig:
    """Options of ``--kv-*`` flags, carried to every process in ``additional_config``."""

    policy: str = "none"
    budget: int | None = None
    ratio: float | None = None
    window: int = 32
    pool_kernel: int | None = None  # None: the policy's own default
    sink_tokens: int | None = None  # None: the policy's own default
    recent_tokens: int | None = None
    merge: bool = True
    alpha: float = 0.5
    mix: float = 0.5
    combine: str = "union"
    filter_layers: tuple[int, ...] = OMNIKV_FILTER_LAYERS
    dense_layers: int = OMNIKV_DENSE_LAYERS
    offload: float | None = None
    pod_tau: float | None = None
    pod_groups: str | None = None
    reserve_growth: bool = True
    tp_allocation: str = "exact"
    page_pool: str | None = None  # None: the platform's (one pool for every layer on CPU, one per layer on CUDA)

    ADDITIONAL_CONFIG_KEY = "kv_policy"

    def __post_init__(self) -> None:
        check_policy_name(self.policy)
        object.__setattr__(self, "filter_layers", tuple(self.filter_layers))  # a list after JSON
        if self.budget is not None and self.budget <= 0:
            raise KVPolicyConfigError(f"--kv-budget must be a positive number of tokens per KV head, got {self.budget}")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise KVPolicyConfigError(f"--kv-ratio is the fraction of prompt tokens kept, in (0, 1]; got {self.ratio}")
        if self.budget is not None and self.ratio is not None:
            raise KVPolicyConfigError("give --kv-budget or --kv-ratio, not both")
        if self.window <= 0:
            raise KVPolicyConfigError(f"--kv-window must be positive, got {self.window}")
        if self.pool_kernel is not None and (self.pool_kernel <= 0 or self.pool_kernel % 2 == 0):
            raise KVPolicyConfigError(f"--kv-pool-kernel must be a positive odd number, got {self.pool_kernel}")
        if (self.sink_tokens or 0) < 0 or (self.recent_tokens or 0) < 0:
            raise KVPolicyConfigError("--kv-sink-tokens and --kv-recent-tokens must be >= 0")
        if not self.filter_layers or sorted(set(self.filter_layers)) != list(self.filter_layers):
            raise KVPolicyConfigError(
                f"--kv-filter-layers must be distinct layer indices in increasing order, got {self.filter_layers}"
            )
        if self.dense_layers < 0:
            raise KVPolicyConfigError(f"--kv-dense-layers must be >= 0, got {self.dense_layers}")
        policy = POLICIES[self.policy]
        if self.offload is not None:
            if policy.mode is not Mode.SELECT:
                raise KVPolicyConfigError(f"--kv-offload applies to --kv-policy omnikv, not {self.policy}")
            if self.offload <= 0:
                raise KVPolicyConfigError(f"--kv-offload is the host pool's size in GiB, > 0; got {self.offload}")
        if (self.pod_tau is not None or self.pod_groups is not None) and policy.mode is not Mode.SHARE:
            raise KVPolicyConfigError(f"--kv-pod-tau and --kv-pod-groups apply to --kv-policy pod, not {self.policy}")
        if self.pod_tau is not None and not 0.0 <= self.pod_tau <= 1.0:
            raise KVPolicyConfigError(f"--kv-pod-tau is a gate threshold in [0, 1], got {self.pod_tau}")
        if self.pod_groups is not None and not Path(self.pod_groups).is_file():
            raise KVPolicyConfigError(
                f"--kv-pod-groups {self.pod_groups}: no such file; make one with `python -m kvpolicy.calibrate_pod --model MODEL --out PATH`"
            )
        for name in ("alpha", "mix"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise KVPolicyConfigError(f"--kv-{name} must be in [0, 1], got {getattr(self, name)}")
        if self.combine not in ("blend", "union"):
            raise KVPolicyConfigError(f"--kv-combine is blend or union, got {self.combine!r}")
        if self.tp_allocation not in ("exact", "rank"):
            raise KVPolicyConfigError(f"--kv-tp-allocation is exact or rank, got {self.tp_allocation!r}")
        if self.page_pool not in (None, "model", "layer"):
            raise KVPolicyConfigError(f"--kv-page-pool is model or layer, got {self.page_pool!r}")
        if self.page_pool is not None and policy.mode is not Mode.RELOCATE:
            raise KVPolicyConfigError(
                f"--kv-page-pool applies to policies that relocate pages per layer, not to --kv-policy {self.policy}"
            )
        defaults = KVPolicyConfig.__dataclass_fields__
        for name in ("merge", "alpha", "mix", "combine"):
            if getattr(self, name) != defaults[name].default and name not in {f.name for f in fields(policy)}:
                takers = sorted(p for p, cls in POLICIES.items() if name in {f.name for f in fields(cls)})
                raise KVPolicyConfigError(
                    f"--kv-{name} applies to {', '.join(takers)}, not to --kv-policy {self.policy}"
                )
        if policy.needs_budget and self.budget is None and self.ratio is None:
            raise KVPolicyConfigError(f"--kv-policy {self.policy} needs --kv-budget or --kv-ratio")
        if policy.needs_window and self.budget is not None and self.budget <= self.window:
            raise KVPolicyConfigError(
                f"--kv-budget {self.budget} must be larger than the observation window "
                f"--kv-window {self.window}, which {self.policy} always keeps"
            )

    @property
    def compresses(self) -> bool:
        """Whether requests leave vLLM's stock layout (anything but ``none`` and ``omnikv``)."""
        return POLICIES[self.policy].mode in (Mode.RELOCATE, Mode.SHARE)

    @property
    def rewrites_blocks(self) -> bool:
        """Whether vLLM blocks may hold something else than their tokens: relocation or offload."""
        return self.compresses or self.offload is not None

    @property
    def changes_attention(self) -> bool:
        """Whether some request attends to anything but vLLM's stock cache (anything but ``none``)."""
        return self.compresses or POLICIES[self.policy].mode is Mode.SELECT

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
        if override is not None:
            budget = override
        elif self.budget is not None:
            budget = self.budget
        elif self.ratio is not None:
            budget = max(1, round(self.ratio * prompt_len))
        else:
            return None
        if POLICIES[self.policy].needs_window:
            budget = max(budget, self.window + 1)
        return budget if budget < prompt_len else None

    def request_policies(self) -> list[str]:
        """What a request's ``kv_policy`` may name on this server: ``none`` (it stays on vLLM's stock
        path) and the server's policy family (policies that differ only in which tokens they keep)."""
        family = POLICIES[self.policy].family_name()
        same = sorted(name for name, cls in POLICIES.items() if cls.family_name() == family and name != "none")
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
        return options

    def check_request_budget(self, value, max_model_len: int) -> int:
        """A per-request ``kv_budget`` (``vllm_xargs``): an int in (window, max_model_len]."""
        if not self.changes_attention or not POLICIES[self.policy].needs_budget:
            raise KVPolicyConfigError(
                f"kv_budget applies to compressing policies; this server runs --kv-policy {self.policy}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise KVPolicyConfigError(f"kv_budget must be a positive integer number of tokens, got {value!r}")
        if value > max_model_len:
            raise KVPolicyConfigError(f"kv_budget {value} is larger than the context limit {max_model_len}")
        if POLICIES[self.policy].evicts_while_reading and self.budget is not None and value > self.budget:
            raise KVPolicyConfigError(
                f"kv_budget {value} is larger than --kv-budget {self.budget}, which sized the KV pool "
                f"for {self.policy} requests; ask for at most {self.budget}"
            )
        if POLICIES[self.policy].needs_window and value <= self.window:
            raise KVPolicyConfigError(
                f"kv_budget {value} must be larger than the observation window ({self.window} tokens)"
            )
        return value

    def make_policy(self):
        """The policy with these options; options left unset (None) keep the policy's own defaults."""
        options = {name: value for name, value in self.to_dict().items() if value is not None}
        options.update(tau=self.pod_tau, groups=self.pod_groups)
        return make_policy(self.policy, **options)

    def check_model_len(self, max_model_len: int) -> None:
        if self.budget is not None and self.budget > max_model_len:
            raise KVPolicyConfigError(
                f"--kv-budget {self.budget} is larger than --max-model-len {max_model_len}: "
                "no prompt could be compressed; lower the budget or raise --max-model-len"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict | None) -> KVPolicyConfig:
        values = values or {}
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise KVPolicyConfigError(f"unknown kv_policy options: {sorted(unknown)}")
        return cls(**values)
