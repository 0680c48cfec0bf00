#!/usr/bin/env bash
# Compiles every kernels/*.hip with nvcc the way `cargo xtask kernels` does for an sm_* target,
# then builds and runs the kernel harness (kernels/tests/harness.cu) against its C++ references.
# Usage (repository root, on a machine with nvcc and an NVIDIA GPU): kernels/tests/run-nvcc.sh [sm_90] [out-dir]
set -euo pipefail
arch="${1:-sm_90}"
out="${2:-${TMPDIR:-/tmp}/ember-kernels-$arch}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$out"
for source in "$root"/kernels/*.hip; do
    module="$(basename "$source" .hip)"
    nvcc -cubin -arch="$arch" -O3 -std=c++17 -x cu -I "$root/kernels" -o "$out/$module.cubin" "$source"
    echo "compiled $module.cubin ($(stat -c %s "$out/$module.cubin") bytes)"
done
nvcc -std=c++17 -O2 -arch="$arch" -x cu -I "$root/kernels" "$root/kernels/tests/harness.cu" -o "$out/harness"
"$out/harness"
