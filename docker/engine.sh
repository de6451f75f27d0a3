#!/usr/bin/env bash
# A Docker engine that answers: Debian's docker.io, installed when missing and started in the
# background when no service manager runs it (this machine kind boots none).
set -euo pipefail
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
if ! command -v dockerd >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends docker.io
fi
if ! docker info >/dev/null 2>&1; then
  mkdir -p .cache
  $SUDO nohup dockerd >.cache/dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  if ! docker info >/dev/null 2>&1; then
    echo "dockerd did not start; the end of .cache/dockerd.log:" >&2
    tail -5 .cache/dockerd.log >&2
    exit 1
  fi
fi
