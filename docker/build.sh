#!/usr/bin/env bash
# Build the CPU image `kvpolicy` from the top-level Dockerfile (`make image`).
#
# Two things this machine kind needs, both optional elsewhere:
# - Docker Hub does not answer here, so when python:3.11-slim can be neither found nor pulled,
#   the base is Debian bookworm with Debian's Python 3.11 and its headers (torch.compile builds C++
#   against Python.h when the server starts), made from Debian's packages by debootstrap.
# - pip's settings from the environment go into the image: the wheel folders of PIP_FIND_LINKS
#   (here: the CPU build of torch 2.13.0, which PyPI does not carry) and the CA bundle of PIP_CERT
#   (a proxy that re-signs TLS), copied to docker/build-extras/ for the Dockerfile to use.
set -euo pipefail
cd "$(dirname "$0")/.."
docker/engine.sh

BASE=python:3.11-slim
if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! timeout 60 docker pull "$BASE"; then
  BASE=kvpolicy/python:3.11-bookworm-slim
  if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    echo "python:3.11-slim cannot be pulled: building $BASE from Debian's packages" >&2
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    command -v debootstrap >/dev/null || $SUDO apt-get install -y -qq --no-install-recommends debootstrap
    root=$(mktemp -d)
    $SUDO debootstrap --variant=minbase --include=python3,python3-dev,python3-venv,python3-pip,ca-certificates \
      bookworm "$root" http://deb.debian.org/debian
    # Slim as Debian's own images: no downloaded packages or package lists (the Dockerfile runs
    # apt-get update), and dpkg leaves out documentation (but its licenses), manuals and translations.
    $SUDO chroot "$root" apt-get clean
    $SUDO rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/usr/share/info/*
    $SUDO find "$root"/usr/share/doc -type f ! -name copyright -delete
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
      'path-exclude /usr/share/man/*' 'path-exclude /usr/share/locale/*' 'path-exclude /usr/share/info/*' |
      $SUDO tee "$root"/etc/dpkg/dpkg.cfg.d/slim >/dev/null
    $SUDO tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$BASE"
    $SUDO rm -rf "$root"
  fi
fi

extras=docker/build-extras
find "$extras" -mindepth 1 ! -name README.md -delete
mkdir -p "$extras/wheels"
for dir in ${PIP_FIND_LINKS:-}; do
  [ -d "$dir" ] && find "$dir" -maxdepth 1 -name '*.whl' -exec cp {} "$extras/wheels/" \;
done
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then cp "$PIP_CERT" "$extras/ca-certificates.crt"; fi

docker build --build-arg BASE="$BASE" -t kvpolicy .
