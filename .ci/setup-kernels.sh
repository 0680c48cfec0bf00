#!/usr/bin/env bash
# Installs the kernel toolchain that `cargo xtask kernels` uses when no ROCm is installed:
# Debian's clang-19/lld-19/llvm-19, the HIP headers of libamdhip64-dev, and a ROCm device-library
# directory that covers every AMDGPU target of targets.toml that LLVM 19 can compile.
#
# Why the device libraries are assembled here: bookworm's rocm-device-libs (5.2) stop at gfx9/gfx10,
# trixie's rocm-device-libs-17 reach gfx1150/gfx1151, and the gfx1152/gfx1200/gfx1201 libraries are
# missing only `oclc_isa_version_NNNN.bc`, a one-constant library that llvm-as-19 builds from a
# two-line .ll file mirroring oclc_isa_version_1151.bc.
#
# Idempotent and cached: the result lives in $EMBER_TOOLCHAIN_DIR (default
# ${XDG_CACHE_HOME:-~/.cache}/ember/toolchain) and a second run only checks it. The trixie package is
# fetched with a private apt state directory so the machine's own apt configuration is untouched, and
# from the same mirror the machine already uses (its bookworm sources with the suite renamed).
set -euo pipefail

toolchain_dir="${EMBER_TOOLCHAIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ember/toolchain}"
device_libs_dir="$toolchain_dir/rocm-device-libs"
stamp="$device_libs_dir/.complete"
# The gfx targets whose oclc_isa_version library is built here, with their ISA version constant.
extra_isa_versions=("1152:11502" "1200:12000" "1201:12001")

log() { printf 'setup-kernels: %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_packages() {
    local missing=()
    for tool in clang++-19 ld.lld-19 llvm-as-19 llvm-dis-19; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    [ -f /usr/include/hip/hip_runtime.h ] || missing+=("hip headers")
    if [ "${#missing[@]}" -eq 0 ]; then
        return
    fi
    log "installing clang-19, lld-19, llvm-19 and libamdhip64-dev (missing: ${missing[*]})"
    as_root apt-get -o DPkg::Lock::Timeout=600 update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends \
        clang-19 lld-19 llvm-19 libamdhip64-dev
}

# Writes a deb822 sources file for trixie that reuses the mirror URIs of the machine's own Debian
# sources (main archive only; the security archive has no rocm packages we need).
write_trixie_sources() {
    local out="$1" uris=""
    local files=()
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] && files+=("$f")
    done
    # deb822 entries: the URIs line of a stanza whose suites name a Debian release.
    for f in "${files[@]}"; do
        case "$f" in
            *.sources)
                uris+=" $(awk 'BEGIN{RS=""; FS="\n"}
                    /Suites:[^\n]*(bookworm|trixie|stable)/ && !/Suites:[^\n]*-security/ {
                        for (i = 1; i <= NF; i++) if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i); print $i }
                    }' "$f")"
                ;;
            *)
                uris+=" $(awk '$1 == "deb" && $0 !~ /-security/ && $0 ~ /(bookworm|trixie|stable)/ {
                        for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break }
                    }' "$f")"
                ;;
        esac
    done
    uris="$(printf '%s\n' $uris | grep -v '^$' | sort -u | tr '\n' ' ')"
    if [ -z "${uris// /}" ]; then
        log "no Debian archive found in /etc/apt/sources.list(.d): cannot fetch trixie's rocm-device-libs-17"
        exit 1
    fi
    cat >"$out" <<SOURCES
Types: deb
URIs: $uris
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
}

fetch_trixie_device_libs() {
    local work="$toolchain_dir/apt"
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/etc/preferences.d" "$work/debs"
    write_trixie_sources "$work/etc/trixie.sources"
    local apt_opts=(
        -o "Dir::Etc::SourceList=$work/etc/trixie.sources"
        -o "Dir::Etc::SourceParts=-"
        -o "Dir::Etc::PreferencesParts=$work/etc/preferences.d"
        -o "Dir::State::Lists=$work/lists"
        -o "Dir::State::Status=/dev/null"
        -o "Dir::Cache=$work/cache"
        -o "APT::Architecture=amd64"
        -o "Debug::NoLocking=1"
        -o "APT::Sandbox::User=root"
    )
    log "fetching rocm-device-libs-17 from trixie (private apt state in $work)"
    apt-get "${apt_opts[@]}" update -q
    (cd "$work/debs" && apt-get "${apt_opts[@]}" download rocm-device-libs-17)
    local deb
    deb="$(ls "$work"/debs/rocm-device-libs-17_*.deb | head -n1)"
    rm -rf "$work/unpacked"
    dpkg -x "$deb" "$work/unpacked"
    local bitcode
    bitcode="$(dirname "$(find "$work/unpacked" -name 'oclc_isa_version_1151.bc' | head -n1)")"
    if [ ! -f "$bitcode/ocml.bc" ]; then
        log "unexpected layout of $deb: no ocml.bc next to oclc_isa_version_1151.bc"
        exit 1
    fi
    rm -rf "$device_libs_dir"
    mkdir -p "$device_libs_dir"
    cp "$bitcode"/*.bc "$device_libs_dir/"
    basename "$deb" >"$device_libs_dir/.source"
}

build_isa_version_libs() {
    local reference="$device_libs_dir/oclc_isa_version_1151.bc"
    local template
    template="$(llvm-dis-19 -o - "$reference")"
    # The reference library holds one constant, __oclc_ISA_version = 11501; every other line (target
    # triple, data layout, attributes) is shared by all gfx targets of this release.
    if ! grep -q '11501' <<<"$template"; then
        log "oclc_isa_version_1151.bc does not hold the constant 11501; refusing to derive others from it"
        exit 1
    fi
    local entry gfx version
    for entry in "${extra_isa_versions[@]}"; do
        gfx="${entry%%:*}"
        version="${entry##*:}"
        if [ -f "$device_libs_dir/oclc_isa_version_$gfx.bc" ]; then
            continue
        fi
        sed -e "s/11501/$version/" -e "s/oclc_isa_version_1151/oclc_isa_version_$gfx/g" <<<"$template" \
            | grep -v '^; ModuleID' >"$device_libs_dir/oclc_isa_version_$gfx.ll"
        llvm-as-19 -o "$device_libs_dir/oclc_isa_version_$gfx.bc" "$device_libs_dir/oclc_isa_version_$gfx.ll"
        rm "$device_libs_dir/oclc_isa_version_$gfx.ll"
        log "built oclc_isa_version_$gfx.bc (__oclc_ISA_version = $version)"
    done
}

install_packages
if [ -f "$stamp" ]; then
    log "device libraries already in $device_libs_dir"
else
    fetch_trixie_device_libs
    build_isa_version_libs
    touch "$stamp"
fi
log "ready: clang $(clang++-19 --version | head -n1 | sed 's/.*version //'), device libraries in $device_libs_dir"
