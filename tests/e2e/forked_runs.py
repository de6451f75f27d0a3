"""Engine runs and ``vllm`` commands forked from one process that has imported vLLM already, instead of each
from a fresh interpreter.

Starting Python, torch and vLLM is most of a small engine run. A ``forkserver`` imports them once, with the settings
every ``engine_run.py`` run sets anyway; each run is a process forked from it that runs ``engine_run.main`` as the
script does, with its own engine and plugin state, and a ``vllm`` command runs the console script's ``main`` in the
environment the test gives it. The server never imports kvpolicy, so each run takes kvpolicy from the tree under test
and ``--stock`` runs load no plugin. What it saves: docs/benchmarks.md#how-engine-runs-stay-deterministic-and-cheap.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import sys
from multiprocessing import forkserver
from pathlib import Path

#: Imported once by the server, in the order a run first imports them (0.15 s of a tiny model's run was importing
#: the ones after ``llama``); the last does work each run would otherwise repeat (``forkserver_warmup.py``). None
#: is CPU-only (the CPU model runner extends the GPU one): on CUDA the runs must fork before CUDA starts, as vLLM
#: requires (not yet run on a GPU).
PRELOAD = (
    "torch",
    "transformers",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.inputs",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.layers.quantization.online.base",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.v1.watermarking.factory",
    "vllm.distributed.aux_output_connector.worker",
    "vllm.v1.kv_offload.factory",
    "vllm.distributed.elastic_ep.elastic_execute",
    "vllm.plugins.lora_resolvers.filesystem_resolver",
    "numpy.ma",
    "tests.e2e.forkserver_warmup",
)
#: What ``engine_run.main`` sets in every run, set before the imports too (OpenMP reads its thread count at load).
RUN_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_ATTN_SPLIT_KV": "0"}


def _no_collection(generation: int = 2) -> int:
    """``gc.collect`` in a forked engine run (``_engine_run``): nothing collected."""
    return 0


def _inherit_server_work() -> None:
    """In the forked process: what the server registered once is not registered again (``forkserver_warmup.py``,
    one of the server's modules: importing it runs nothing anew)."""
    from tests.e2e.forkserver_warmup import skip_inherited_registration

    skip_inherited_registration()


def _output_to(stdout: str, stderr: str) -> None:
    """In the forked process: file descriptors 1 and 2 write to these files."""
    for fd, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)


def _engine_run(argv: list[str], stdout: str, stderr: str) -> None:
    """In the forked process: ``engine_run.py *argv`` with its output in two files, exiting as the script would.

    What the server imported is frozen out of the garbage collector first: vLLM collects several times while it
    starts, and each full pass would walk every preloaded module's objects (about 1.3 s of a run's CPU time).
    Those explicit full collections are then skipped altogether (the collector still runs on its own): vLLM
    makes them to measure free memory and to free it at shutdown, which a process that exits after one run
    does not need.
    """
    gc.freeze()
    gc.collect = _no_collection
    _inherit_server_work()
    _output_to(stdout, stderr)
    from tests.e2e import engine_run

    sys.argv = [engine_run.__file__, *argv]
    try:
        code = engine_run.main()
    finally:
        atexit._run_exitfuncs()  # a forked process ends with os._exit; vLLM shuts its engine down at exit
    sys.exit(code)


def _vllm_command(argv: list[str], env: dict[str, str], stdout: str, stderr: str) -> None:
    """In the forked process: ``vllm *argv`` in ``env``, as the console script runs it (its exit status is the
    process's, an uncaught exception's traceback goes to stderr)."""
    os.environ.clear()
    os.environ.update(env)
    _inherit_server_work()
    _output_to(stdout, stderr)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    try:
        main()
    finally:
        atexit._run_exitfuncs()


class ForkedRuns:
    """Processes forked from one forkserver: ``engine_run.py`` runs and ``vllm`` commands. The server starts at
    the first (with ``RUN_ENV`` for it alone), so a test worker that needs none starts none."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.started = False

    def _start(self) -> None:
        self.context.set_forkserver_preload(list(PRELOAD))
        saved = {name: os.environ.get(name) for name in RUN_ENV}
        os.environ.update(RUN_ENV)
        try:
            forkserver.ensure_running()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
        self.started = True

    def _fork(self, command: str, target, args: tuple, log_stem: Path, timeout: float) -> tuple[int, str, str]:
        """``target(*args, stdout_file, stderr_file)``, which runs ``command``, in a forked process: its exit code,
        stdout and stderr (which stay in ``log_stem.*``)."""
        if not self.started:
            self._start()
        stdout, stderr = log_stem.with_suffix(".stdout"), log_stem.with_suffix(".stderr")
        process = self.context.Process(target=target, args=(*args, str(stdout), str(stderr)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise TimeoutError(f"{command} ran over {timeout} s")
        return process.exitcode, stdout.read_text(), stderr.read_text()

    def engine_run(self, argv: list[str], log_stem: Path, timeout: float) -> tuple[int, str]:
        """``engine_run.py *argv``: its exit code and its stderr."""
        code, _, stderr = self._fork(f"engine_run.py {' '.join(argv)}", _engine_run, (argv,), log_stem, timeout)
        return code, stderr

    def vllm(
        self, argv: list[str], log_stem: Path, timeout: float, env: dict[str, str] | None = None
    ) -> tuple[int, str, str]:
        """``vllm *argv`` (in ``env``, else this process's environment): its exit code, stdout and stderr."""
        env = dict(os.environ if env is None else env)
        return self._fork(f"vllm {' '.join(argv)}", _vllm_command, (argv, env), log_stem, timeout)
