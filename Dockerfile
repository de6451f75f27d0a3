# CPU image: vLLM's CPU backend + kvpolicy + the default model, prepared at build time.
# `torch==2.13.0` must resolve to the CPU build: point pip at an index or a
# folder that has it (PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS build args).
# Not built in this project's CI (its machines run no Docker engine).
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PIP_FIND_LINKS=${PIP_FIND_LINKS} \
    KVPOLICY_CACHE=/opt/kvpolicy-cache HOST=0.0.0.0
RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ libnuma1 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kvpolicy
COPY . .
RUN make model
EXPOSE 8000
CMD ["make", "serve"]
