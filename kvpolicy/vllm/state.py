"""What one worker process knows about kvpolicy requests, shared by its backend and worker hook."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpolicy.config import KVPolicyConfig
from kvpolicy.paging import RequestPages
from kvpolicy.policies import POLICIES, Policy


@dataclass
class WorkerState:
    """Per worker process: the policy, the model runner (to map batch rows to
    request ids) and the page tables of every relocated request."""

    config: KVPolicyConfig | None = None
    policy: Policy | None = None
    runner: Any = None
    requests: dict[str, RequestPages] = field(default_factory=dict)
    relocated_requests: int = 0

    def configure(self, config: KVPolicyConfig | None, runner: Any) -> None:
        self.config = config
        self.policy = POLICIES[config.policy]() if config is not None else None
        self.runner = runner
        self.requests.clear()

    @property
    def relocates(self) -> bool:
        return self.policy is not None and self.policy.relocates and self.runner is not None

    def forget(self, req_ids) -> None:
        for req_id in req_ids or ():
            self.requests.pop(req_id, None)


WORKER_STATE = WorkerState()
