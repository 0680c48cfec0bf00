#!/usr/bin/env bash
# Makes `python3` with the `venv` and `ensurepip` modules available, which the server tests need:
# `cargo xtask test` builds a venv under target/ from tests/server/requirements.txt (the pinned
# `openai` client, httpx, pytest) for `pytest tests/server` and `cargo xtask smoke --image`.
# Idempotent: a machine that has them installs nothing. Debian ships venv's ensurepip in a package
# of its own (python3-venv); pip itself then comes from ensurepip inside the venv.
set -euo pipefail

log() { printf 'setup-python: %s\n' "$*" >&2; }

if command -v python3 >/dev/null 2>&1 && python3 -c 'import venv, ensurepip' 2>/dev/null; then
    log "$(python3 --version) with venv and ensurepip already present"
    exit 0
fi
log "installing python3 and python3-venv"
if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo); fi
# Other setup scripts may hold the dpkg lock; wait for it rather than fail.
"${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 update -q
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
    --no-install-recommends python3 python3-venv
python3 -c 'import venv, ensurepip'
log "$(python3 --version) with venv and ensurepip installed"
