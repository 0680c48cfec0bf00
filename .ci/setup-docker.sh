#!/usr/bin/env bash
# Makes a Docker daemon and a local base image available for `cargo xtask docker` and
# `cargo xtask smoke --image`, on a Debian machine without systemd. Idempotent and cached: a second
# run installs nothing, reuses a running daemon, and skips the image when its tag exists.
#
# The official ROCm images cannot be pulled on CI machines without registry access, so the image
# tests build the real Dockerfile on `ember-test-base:bookworm`: a minimal Debian rootfs from
# debootstrap, imported into Docker. The rootfs tarball is cached under ~/.cache/ember/docker so a
# fresh daemon (new machine, same cache) imports it in seconds instead of bootstrapping again.
#
# Environment: EMBER_DOCKER_LOG (daemon log, default target/dockerd.log), EMBER_CACHE_DIR
# (default ~/.cache/ember), EMBER_TEST_BASE (image tag, default ember-test-base:bookworm).
set -euo pipefail
cd "$(dirname "$0")/.."

base_tag="${EMBER_TEST_BASE:-ember-test-base:bookworm}"
suite="bookworm"
cache_dir="${EMBER_CACHE_DIR:-$HOME/.cache/ember}/docker"
rootfs_tar="$cache_dir/debian-$suite-minbase-amd64.tar"
daemon_log="${EMBER_DOCKER_LOG:-$PWD/target/dockerd.log}"

log() { echo "setup-docker: $*"; }

sudo_if_needed() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Packages: only what is missing, so a cached machine never touches apt.
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}"
    # Other setup scripts may hold the dpkg lock; wait for it rather than fail.
    sudo_if_needed apt-get -o DPkg::Lock::Timeout=600 update -qq
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive \
        apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The daemon: reuse a running one; otherwise start it in the background (no systemd here).
if docker info >/dev/null 2>&1; then
    log "dockerd already running"
else
    mkdir -p "$(dirname "$daemon_log")"
    # A pid file left by a daemon that no longer runs (a machine restored from a snapshot, a
    # killed run) makes dockerd refuse to start: remove it when its pid is not a dockerd (the
    # number may have been reused by another process since).
    pidfile=/var/run/docker.pid
    if [[ -f "$pidfile" ]]; then
        pid="$(cat "$pidfile" 2>/dev/null)"
        if [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" != dockerd ]]; then
            log "removing the stale $pidfile (pid $pid is not a running dockerd)"
            sudo_if_needed rm -f "$pidfile"
        fi
    fi
    log "starting dockerd (log: $daemon_log)"
    sudo_if_needed sh -c "nohup dockerd >'$daemon_log' 2>&1 &"
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    if ! docker info >/dev/null 2>&1; then
        log "dockerd did not answer within 60 s; last lines of $daemon_log:"
        tail -n 20 "$daemon_log" >&2 || true
        exit 1
    fi
    log "dockerd is up"
fi

if docker image inspect "$base_tag" >/dev/null 2>&1; then
    log "$base_tag exists"
    exit 0
fi

# The Debian mirror this machine already uses (deb822 .sources or one-line sources.list), so the
# script works behind whatever mirror or proxy the machine is configured for.
debian_mirror() {
    local files=()
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && files+=("$f")
    done
    [ "${#files[@]}" -gt 0 ] || return 1
    # deb822: a stanza whose Suites list the release itself (not -security/-updates only).
    awk -v suite="$suite" '
        /^[[:space:]]*#/ { next }
        /^[[:space:]]*$/ { if (uris != "" && has_suite) { print uris; exit } uris = ""; has_suite = 0; next }
        /^URIs:/ { uris = $2 }
        /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite) has_suite = 1 }
        /^deb[[:space:]]/ {
            # One-line form: deb [options] URI SUITE COMPONENTS...
            n = 2; if ($2 ~ /^\[/) { while ($n !~ /\]$/) n++; n++ }
            if ($(n + 1) == suite) { print $n; exit }
        }
        END { if (uris != "" && has_suite) print uris }
    ' "${files[@]}" | head -n 1
}

if [ ! -s "$rootfs_tar" ]; then
    mirror="$(debian_mirror || true)"
    if [ -z "$mirror" ]; then
        log "no apt source for $suite found in /etc/apt; cannot choose a mirror for debootstrap" >&2
        exit 1
    fi
    log "debootstrap --variant=minbase $suite from $mirror"
    mkdir -p "$cache_dir"
    rootfs_dir="$(mktemp -d "$cache_dir/rootfs.XXXXXX")"
    trap 'sudo_if_needed rm -rf "$rootfs_dir"' EXIT
    sudo_if_needed debootstrap --variant=minbase "$suite" "$rootfs_dir" "$mirror" >"$cache_dir/debootstrap.log" 2>&1 || {
        log "debootstrap failed; last lines of $cache_dir/debootstrap.log:" >&2
        tail -n 20 "$cache_dir/debootstrap.log" >&2
        exit 1
    }
    # Package lists and caches are dead weight in a base image.
    sudo_if_needed rm -rf "$rootfs_dir"/var/cache/apt/archives/*.deb "$rootfs_dir"/var/lib/apt/lists/*
    # Write then rename so an interrupted run never leaves a truncated tarball in the cache.
    sudo_if_needed tar --numeric-owner -C "$rootfs_dir" -cf "$rootfs_tar.partial" .
    mv "$rootfs_tar.partial" "$rootfs_tar"
fi

log "importing $rootfs_tar as $base_tag"
docker import "$rootfs_tar" "$base_tag" >/dev/null
log "$base_tag ready"
