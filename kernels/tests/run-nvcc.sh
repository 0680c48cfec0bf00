#!/usr/bin/env bash
# Compiles every kernels/*.hip with nvcc the way `cargo xtask kernels` does for an sm_* target,
# then builds and runs every kernel harness (kernels/tests/harness*.cu) against its C++
# references. Exits non-zero if any kernel fails to compile, any harness fails to build, or any
# harness reports a failure; every harness runs even after an earlier one failed.
# Usage (repository root, on a machine with nvcc and an NVIDIA GPU): kernels/tests/run-nvcc.sh [sm_90] [out-dir]
set -uo pipefail
arch="${1:-sm_90}"
out="${2:-${TMPDIR:-/tmp}/ember-kernels-$arch}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$out"
failed=()
for source in "$root"/kernels/*.hip; do
    module="$(basename "$source" .hip)"
    if nvcc -cubin -arch="$arch" -O3 -std=c++17 -x cu -I "$root/kernels" -o "$out/$module.cubin" "$source"; then
        echo "compiled $module.cubin ($(stat -c %s "$out/$module.cubin") bytes)"
    else
        echo "FAILED to compile $module.hip"
        failed+=("compile $module.hip")
    fi
done
for harness in "$root"/kernels/tests/harness*.cu; do
    name="$(basename "$harness" .cu)"
    if ! nvcc -std=c++17 -O2 -arch="$arch" -x cu -I "$root/kernels" "$harness" -o "$out/$name"; then
        echo "FAILED to build $name"
        failed+=("build $name")
        continue
    fi
    echo "== running $name"
    if ! "$out/$name"; then
        failed+=("run $name")
    fi
done
if ((${#failed[@]})); then
    echo "run-nvcc.sh: ${#failed[@]} failure(s): ${failed[*]}"
    exit 1
fi
echo "run-nvcc.sh: every kernel compiled and every harness passed"
