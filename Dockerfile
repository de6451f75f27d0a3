# CPU image: vLLM's CPU backend + kvpolicy + the default model, prepared at build time.
# Build it with `make image` (docker/build.sh), run it with `make image-check` (docker/check.sh).
# torch==2.13.0 must resolve to the CPU build: docker/build.sh copies the wheels of PIP_FIND_LINKS
# and the CA bundle of PIP_CERT into docker/build-extras/, which pip is pointed at here.
ARG BASE=python:3.11-slim
FROM ${BASE}
ENV KVPOLICY_CACHE=/opt/kvpolicy-cache HOST=0.0.0.0 PIP_CONFIG_FILE=/etc/kvpolicy-pip.conf
RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kvpolicy
COPY . .
RUN extras=/opt/kvpolicy/docker/build-extras; { \
      echo "[global]"; \
      if ls $extras/wheels/*.whl >/dev/null 2>&1; then echo "find-links = $extras/wheels"; fi; \
      if [ -f $extras/ca-certificates.crt ]; then echo "cert = $extras/ca-certificates.crt"; fi; \
    } > /etc/kvpolicy-pip.conf \
    && make model PYTHON=python3 && rm -rf /root/.cache/pip
ENV PATH=/opt/kvpolicy/.venv/bin:$PATH
EXPOSE 8000
CMD ["server/serve.sh"]
