#!/usr/bin/env bash
# Installs what `cargo xtask build --os windows` needs to cross-compile ember.exe on Debian:
# the Rust standard library for x86_64-pc-windows-gnu and MinGW-w64's gcc (the linker Rust uses
# for that target). Idempotent: a second run only checks.
set -euo pipefail

rust_target="x86_64-pc-windows-gnu"
log() { printf 'setup-windows: %s\n' "$*" >&2; }
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if ! command -v x86_64-w64-mingw32-gcc >/dev/null 2>&1; then
    log "installing gcc-mingw-w64-x86-64"
    as_root apt-get -o DPkg::Lock::Timeout=600 update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends gcc-mingw-w64-x86-64
fi
if ! rustup target list --installed | grep -qx "$rust_target"; then
    log "adding the Rust target $rust_target"
    rustup target add "$rust_target"
fi
log "ready: $(x86_64-w64-mingw32-gcc --version | head -n1); rust target $rust_target installed"
