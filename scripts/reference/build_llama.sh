#!/usr/bin/env bash
# Builds the llama.cpp that the reference logits come from, and dump_logits.c against it.
#
# The source is the llama.cpp vendored in the PyPI sdist of llama-cpp-python 0.3.36 (llama.cpp
# commit 0c1e57098, mid-2026), the same snapshot the project's speed comparisons use. It is
# fetched with pip, checked against its SHA-256, unpacked and built under target/reference/
# (never committed): only the `llama` library target with CMake, CPU backend, AVX2/AVX-512 flags
# taken from /proc/cpuinfo (GGML_NATIVE off, AMX never: the OS here refuses AMX tile state).
#
# Why CMake on the vendored tree rather than `pip install llama-cpp-python` from source into a
# venv: both compile the same llama.cpp, but the pip route also builds llama.cpp's `common`
# library and the multimodal `mtmd` library and packages a wheel, and the Python side would need
# numpy. Measured on a 2-core machine (2026-12-02, same compiler flags): this script 2m43s
# (3m03s of CPU), `pip install --no-binary llama-cpp-python` into a venv 13m00s (10m46s of CPU;
# it ran beside a cargo build, so its CPU time is the fairer figure).
#
# Usage: scripts/reference/build_llama.sh   (prints the path of dump_logits on its last line)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
work="$repo/target/reference"
version=0.3.36
sdist_sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
sdist="$work/llama_cpp_python-$version.tar.gz"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
build="$work/build"
mkdir -p "$work/bin"

if [ ! -f "$sdist" ]; then
    # Only llama-cpp-python itself must come as source; its build requirements may be wheels.
    pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work"
fi
echo "$sdist_sha256  $sdist" | sha256sum --check --quiet -
if [ ! -d "$src" ]; then
    tar -xzf "$sdist" -C "$work"
fi

flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
cpu_flags=(
    -DGGML_AVX="$(onoff avx)"
    -DGGML_AVX2="$(onoff avx2)"
    -DGGML_FMA="$(onoff fma)"
    -DGGML_F16C="$(onoff f16c)"
    -DGGML_AVX512="$(onoff avx512f)"
    -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
    -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
    -DGGML_AVX512_BF16="$(onoff avx512_bf16)"
    -DGGML_AVX_VNNI="$(onoff avx_vnni)"
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)

cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${cpu_flags[@]}" \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF >"$work/cmake-configure.log"
cmake --build "$build" --target llama -j "$(nproc)" >"$work/cmake-build.log"

libdir=$(dirname "$(find "$build" -name 'libllama.so' | head -n1)")
cc -O2 -std=c11 -Wall -Wextra "$repo/scripts/reference/dump_logits.c" \
    -I "$src/include" -I "$src/ggml/include" -L "$libdir" -lllama -lm \
    -Wl,-rpath,"$libdir" -o "$work/bin/dump_logits"
echo "$work/bin/dump_logits"
