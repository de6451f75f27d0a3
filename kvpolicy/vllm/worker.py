"""The worker hook: publishes the model runner and drops state of finished requests."""

from __future__ import annotations

import importlib

from kvpolicy.vllm.args import stored_config
from kvpolicy.vllm.internals import CPU_WORKER_MODULE
from kvpolicy.vllm.state import WORKER_STATE

CPUWorker = importlib.import_module(CPU_WORKER_MODULE).CPUWorker


class KVPolicyCPUWorker(CPUWorker):
    """vLLM's CPU worker, plus the two things the per-head backend needs from it."""

    def init_device(self):
        super().init_device()
        WORKER_STATE.configure(stored_config(self.vllm_config.additional_config), self.model_runner)

    def execute_model(self, scheduler_output, *args, **kwargs):
        WORKER_STATE.forget(scheduler_output.finished_req_ids)
        WORKER_STATE.forget(scheduler_output.preempted_req_ids)
        return super().execute_model(scheduler_output, *args, **kwargs)
