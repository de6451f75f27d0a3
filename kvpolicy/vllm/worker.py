"""The worker hook: publishes the model runner and drops state of finished requests.

One mixin over the platform's worker: ``KVPolicyCPUWorker`` (vLLM's CPU
worker) and ``KVPolicyGPUWorker`` (its GPU worker), each made on first
access so that a platform never imports the other's worker module.
"""

from __future__ import annotations

import importlib

from kvpolicy.vllm.args import stored_config
from kvpolicy.vllm.connector import own_metadata
from kvpolicy.vllm.internals import (
    CPU_WORKER_MODULE,
    GPU_WORKER_MODULE,
    ensure_intermediate_tensors,
    pipeline_stage,
    tensor_parallel_gather,
)
from kvpolicy.vllm.stage import STAGE
from kvpolicy.vllm.state import WORKER_STATE

#: class name -> (vLLM's worker module, its worker class)
_PLATFORM_WORKERS = {
    "KVPolicyCPUWorker": (CPU_WORKER_MODULE, "CPUWorker"),
    "KVPolicyGPUWorker": (GPU_WORKER_MODULE, "Worker"),
}


class KVPolicyWorkerHooks:
    """What the backends need from a worker: the runner, which requests are gone, and which of
    their blocks other requests share (the scheduler's connector metadata)."""

    def init_device(self):
        super().init_device()
        parallel = self.vllm_config.parallel_config.tensor_parallel_size > 1
        STAGE.rank, _ = pipeline_stage()
        STAGE.first_layer, _ = self.vllm_config.model_config.get_layers_start_end_indices(
            self.vllm_config.parallel_config
        )
        WORKER_STATE.configure(
            stored_config(self.vllm_config.additional_config),
            self.model_runner,
            tensor_parallel_gather() if parallel else None,
        )

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        ensure_intermediate_tensors(self.model_runner)
        return times

    def execute_model(self, scheduler_output, *args, **kwargs):
        WORKER_STATE.forget(scheduler_output.finished_req_ids)
        WORKER_STATE.forget(scheduler_output.preempted_req_ids)
        metadata = own_metadata(scheduler_output.kv_connector_metadata)
        WORKER_STATE.block_sharing = metadata.sharing if metadata is not None else {}
        return super().execute_model(scheduler_output, *args, **kwargs)


def __getattr__(name: str):
    if name not in _PLATFORM_WORKERS:
        raise AttributeError(name)
    module, base = _PLATFORM_WORKERS[name]
    cls = type(name, (KVPolicyWorkerHooks, getattr(importlib.import_module(module), base)), {"__module__": __name__})
    globals()[name] = cls
    return cls
