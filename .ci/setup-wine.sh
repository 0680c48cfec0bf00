#!/usr/bin/env bash
# Installs wine so CI can run the Windows artifact (`ember.exe`, cross-compiled for
# x86_64-pc-windows-gnu) through `cargo xtask smoke --artifact <zip>` and `cargo xtask test`.
# Idempotent: a machine that already has a 64-bit wine installs nothing.
#
# Only the 64-bit loader is needed (ember.exe is x86_64), so there is no i386 multiarch set-up.
# The wine prefix is not made here: xtask makes a private one in target/wine-prefix on first use
# (xtask/src/wine.rs), including the bcryptprimitives.dll stand-in that bookworm's Wine 8 lacks,
# built with the MinGW compiler that .ci/setup-windows.sh installs.
set -euo pipefail

log() { echo "setup-wine: $*"; }

sudo_if_needed() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Debian's `wine64` ships the 64-bit loader as /usr/lib/wine/wine64; `wine` adds the launchers
# (`wine` on PATH, which xtask looks for first).
have_wine() {
    command -v wine >/dev/null 2>&1 || command -v wine64 >/dev/null 2>&1
}

if have_wine; then
    log "wine already installed"
else
    log "installing wine64 wine"
    # Other setup scripts may hold the dpkg lock; wait for it rather than fail.
    sudo_if_needed apt-get -o DPkg::Lock::Timeout=600 update -qq
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive \
        apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends wine64 wine >/dev/null
fi

if ! have_wine; then
    log "expected wine or wine64 on PATH after installing wine64 and wine, found neither" >&2
    exit 1
fi
log "$(WINEDEBUG=-all "$(command -v wine || command -v wine64)" --version) ready"
