#!/usr/bin/env bash
# Installs wine so CI can run the Windows artifact (`ember.exe`, cross-compiled for
# x86_64-pc-windows-gnu) through `cargo xtask smoke --artifact <zip>`. Idempotent: a machine that
# already has a 64-bit wine installs nothing.
#
# Only the 64-bit loader is needed (ember.exe is x86_64), so there is no i386 multiarch set-up.
# The wine prefix is not created here: the smoke test makes a private one under target/ on first
# use, so it never touches ~/.wine.
set -euo pipefail

log() { echo "setup-wine: $*"; }

sudo_if_needed() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Debian's `wine64` ships the loader as /usr/lib/wine/wine64; `wine` adds the /usr/bin/wine
# launcher that picks it.
have_wine() {
    command -v wine >/dev/null 2>&1 || command -v wine64 >/dev/null 2>&1 || [ -x /usr/lib/wine/wine64 ]
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
    log "wine is still missing after installing wine64 and wine" >&2
    exit 1
fi
log "$( (command -v wine || command -v wine64 || echo /usr/lib/wine/wine64) | head -n 1)"
