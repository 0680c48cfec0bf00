#!/usr/bin/env bash
# Installs, in one apt transaction, the Debian packages that the other .ci/setup-*.sh scripts
# install one by one when run alone: the kernel toolchain (clang-19, lld-19, llvm-19,
# libamdhip64-dev), MinGW-w64 for the Windows build, wine, docker.io and debootstrap, python3-venv.
# One `apt-get update` and one install instead of five saves the repeated index downloads and
# dpkg start-ups on a fresh CI machine; the per-area scripts then find everything present and only
# do their own set-up. Idempotent: a machine that has every package touches nothing.
set -euo pipefail

packages=(
    clang-19 lld-19 llvm-19 libamdhip64-dev # setup-kernels.sh
    gcc-mingw-w64-x86-64                    # setup-windows.sh
    wine64 wine                             # setup-wine.sh
    docker.io debootstrap                   # setup-docker.sh
    python3 python3-venv                    # setup-python.sh, setup-actionlint.sh
)
log() { printf 'setup-packages: %s\n' "$*" >&2; }
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

missing=()
for package in "${packages[@]}"; do
    if [ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null)" != "install ok installed" ]; then
        missing+=("$package")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    log "all ${#packages[@]} packages already installed"
    exit 0
fi
log "installing ${missing[*]}"
# Another apt user may hold the dpkg lock; wait for it rather than fail.
as_root apt-get -o DPkg::Lock::Timeout=600 update -qq
as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null
log "installed ${#missing[@]} package(s)"
