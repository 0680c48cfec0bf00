#!/usr/bin/env bash
# Supply-chain checks with cargo-deny against deny.toml: licences, banned and duplicate crates,
# crate sources, then security advisories where the advisory database can be fetched (it lives on
# GitHub; machines without that access check the rest offline and say so).
#
# The cargo-deny binary is cached under ${EMBER_CACHE_DIR:-~/.cache/ember}/tools/cargo-deny, keyed
# by version, so only a machine's first run pays for it. It is built with `cargo install --locked`
# (6 to 8 minutes on 2 cores): the prebuilt release binaries are on GitHub, which CI machines here
# cannot reach, so no pinned download can be checked.
set -euo pipefail
cd "$(dirname "$0")/.."

version="0.20.2"
root="${EMBER_CACHE_DIR:-$HOME/.cache/ember}/tools/cargo-deny"
deny="$root/bin/cargo-deny"

log() { echo "deny: $*"; }

if ! "$deny" --version 2>/dev/null | grep -qx "cargo-deny $version"; then
    log "installing cargo-deny $version into $root (cached for later runs)"
    # Its own target directory, and none of this workspace's RUSTFLAGS: nothing of it is shipped.
    build_dir="$(mktemp -d)"
    trap 'rm -rf "$build_dir"' EXIT
    env -u RUSTFLAGS -u CFLAGS -u CXXFLAGS CARGO_TARGET_DIR="$build_dir" \
        cargo install --locked --quiet --version "$version" --root "$root" cargo-deny
fi
log "$("$deny" --version)"

"$deny" --offline check --hide-inclusion-graph licenses bans sources
# The advisory database: fetched when GitHub answers, else skipped out loud.
if timeout 60 "$deny" fetch db >/dev/null 2>&1; then
    "$deny" --offline check --hide-inclusion-graph advisories
else
    log "advisory database not reachable from this machine: advisories not checked here (the release workflow checks them)"
fi
