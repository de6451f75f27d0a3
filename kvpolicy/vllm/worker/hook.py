"""The worker hook: makes the worker's kvpolicy state and hands it out, and drops finished requests.

One mixin over the platform's worker (``KVPolicyCPUWorker``, ``KVPolicyGPUWorker``, each made on first access so
that a platform never imports the other's worker module). The worker owns its ``WorkerState`` and the mode over
it; once vLLM has made the KV cache, the metadata builders and the KV connector (``initialize_from_config``), the
hook binds the state to kvpolicy's builders (which build each step with the mode and attach the mode's path) and
to kvpolicy's connector (which reads the step's releases and counters).
"""

from __future__ import annotations

import importlib

from kvpolicy.config import KVPolicyConfig
from kvpolicy.vllm.internals import (
    CPU_WORKER_MODULE,
    GPU_WORKER_MODULE,
    attention_metadata_builders,
    decode_rows_scheduled,
    ensure_intermediate_tensors,
    pipeline_stage,
    prompt_rows_scheduled,
    tensor_parallel_gather,
    worker_connectors,
)
from kvpolicy.vllm.messages import own_metadata
from kvpolicy.vllm.patches import forbid_full_graphs_while
from kvpolicy.vllm.worker.diagnostics import Diagnostics
from kvpolicy.vllm.worker.modes import make_mode
from kvpolicy.vllm.worker.state import WorkerState
from kvpolicy.vllm.worker.step_builder import KVPolicyMetadataBuilder

#: class name -> (vLLM's worker module, its worker class)
_PLATFORM_WORKERS = {
    "KVPolicyCPUWorker": (CPU_WORKER_MODULE, "CPUWorker"),
    "KVPolicyGPUWorker": (GPU_WORKER_MODULE, "Worker"),
}


class KVPolicyWorkerHooks:
    """What the backends and the connector need from a worker: the runner, which requests are gone,
    and which of their blocks other requests share (the scheduler's connector metadata)."""

    kvpolicy: WorkerState

    def init_device(self):
        super().init_device()
        parallel = self.vllm_config.parallel_config.tensor_parallel_size > 1
        stage_rank, _ = pipeline_stage()
        first_layer, _ = self.vllm_config.model_config.get_layers_start_end_indices(self.vllm_config.parallel_config)
        self.kvpolicy = WorkerState.of(
            KVPolicyConfig.stored_in(self.vllm_config.additional_config),
            self.model_runner,
            tensor_parallel_gather() if parallel else None,
            (stage_rank, first_layer),
        )
        self.kvpolicy.mode = make_mode(self.kvpolicy)
        self.kvpolicy.diagnostics = Diagnostics.from_env(self.rank)

    def initialize_from_config(self, kv_cache_config):
        super().initialize_from_config(kv_cache_config)
        for builder in attention_metadata_builders(self.model_runner):
            if isinstance(builder, KVPolicyMetadataBuilder):
                builder.bind(self.kvpolicy)
        if self.kvpolicy.fixed_decode:  # a step that reads a prompt has host work after attention
            forbid_full_graphs_while(self.model_runner, lambda: self.kvpolicy.prompt_in_step)
        for connector in worker_connectors():  # kvpolicy's, alone or a child of vLLM's MultiConnector
            bind = getattr(connector, "bind_worker", None)
            if bind is not None:
                bind(self.kvpolicy)

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        ensure_intermediate_tensors(self.model_runner)
        for builder in attention_metadata_builders(self.model_runner):
            if isinstance(builder, KVPolicyMetadataBuilder):
                builder.warm_up()
        return times

    def execute_model(self, scheduler_output, *args, **kwargs):
        self.kvpolicy.forget(scheduler_output.finished_req_ids)
        self.kvpolicy.forget(scheduler_output.preempted_req_ids)
        metadata = own_metadata(scheduler_output.kv_connector_metadata)
        self.kvpolicy.block_sharing = metadata.sharing if metadata is not None else {}
        if self.kvpolicy.fixed_decode:  # a prompt row, or a decode row with a pass or a query to stash
            runner = self.model_runner
            self.kvpolicy.prompt_in_step = prompt_rows_scheduled(scheduler_output, runner) or (
                self.kvpolicy.mode.decode_work_due(decode_rows_scheduled(scheduler_output, runner))
            )
        diagnostics = self.kvpolicy.diagnostics
        if diagnostics is None:
            return super().execute_model(scheduler_output, *args, **kwargs)
        counts = scheduler_output.num_scheduled_tokens
        with diagnostics.step(decode_only=bool(counts) and all(n == 1 for n in counts.values())):
            return super().execute_model(scheduler_output, *args, **kwargs)


def __getattr__(name: str):
    if name not in _PLATFORM_WORKERS:
        raise AttributeError(name)
    module, base = _PLATFORM_WORKERS[name]
    cls = type(name, (KVPolicyWorkerHooks, getattr(importlib.import_module(module), base)), {"__module__": __name__})
    globals()[name] = cls
    return cls
