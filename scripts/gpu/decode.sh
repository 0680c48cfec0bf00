#!/usr/bin/env bash
# Decode speed on the GPU (H200) beside llama.cpp, and what recording decode steps as several
# graphs (EMBER_GPU_GRAPH_SEGMENT layers per part; 0 = one graph per step) does to it.
#
#   for each model (ember-synth, real shapes, random weights): `ember bench -p 512 -n 128` once
#   per segment setting, and `llama-bench -fa 1 -p 512 -n 128` on the same file; medians of $REPS
#   runs; the graph statistics line (host time per step recording, updating, launching).
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT EMBER=path/to/ember SYNTH=path/to/ember-synth LLAMA_BIN=folder scripts/gpu/decode.sh
# MODELS_LIST: "shape:type ..." (default the three of issue 12); SEGMENTS: settings to compare;
# DEPTHS: cache depths (`-d`) for both engines.
# Prints figures; asserts nothing about speed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-decode}"
ARCH="${ARCH:-sm_90}"
REPS="${REPS:-3}"
MODELS_LIST="${MODELS_LIST:-llama3.2-1b:q4_0 llama3-8b:q4_0 llama3-8b:q4_k_m}"
SEGMENTS="${SEGMENTS:-0 2 4 8}"
# DEPTHS: comma-separated cache depths for both engines (`-d`, as llama-bench), e.g. 0,8192.
DEPTHS="${DEPTHS:-0}"
LLAMA_BIN="${LLAMA_BIN:?LLAMA_BIN: a folder with llama-bench}"
export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
mkdir -p "$OUT" "$MODELS"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }

if [[ ! -d "$EMBER_KERNELS_DIR/$ARCH" ]]; then
    t "kernels for $ARCH"
    mkdir -p "$EMBER_KERNELS_DIR/$ARCH"
    ls "$ROOT"/kernels/*.hip | xargs -P 8 -I{} sh -c \
        'nvcc -cubin -arch="$1" -O3 -std=c++17 -x cu -I "$2/kernels" -o "$3/$(basename "$4" .hip).cubin" "$4" || echo "FAILED $4"' \
        _ "$ARCH" "$ROOT" "$EMBER_KERNELS_DIR/$ARCH" {} >"$OUT/kernels-decode.log" 2>&1
    if grep -q FAILED "$OUT/kernels-decode.log"; then
        grep -A10 FAILED "$OUT/kernels-decode.log" | head -40
        exit 1
    fi
fi
for entry in $MODELS_LIST; do
    shape="${entry%%:*}"
    type="${entry##*:}"
    m="$MODELS/$shape-$type.gguf"
    [[ -s "$m" ]] || "$SYNTH" --shape "$shape" --type "$type" --fast -o "$m" >>"$OUT/synth-decode.log" 2>&1 ||
        { t "$entry: ember-synth failed"; continue; }
    t "$entry"
    for segment in $SEGMENTS; do
        printf '  ember, EMBER_GPU_GRAPH_SEGMENT=%s: ' "$segment"
        EMBER_GPU_GRAPH_SEGMENT="$segment" EMBER_LOG=info "$EMBER" bench -m "$m" --device cuda:0 -ngl 99 \
            -p 512 -n 128 -d "$DEPTHS" -r "$REPS" 2>"$OUT/decode-$shape-$type-$segment.err" | grep -E "tg128|pp512" | tr '\n' ' '
        echo
        grep -o "graph steps.*per step: [^;]*" "$OUT/decode-$shape-$type-$segment.err" | tail -1 | sed 's/^/    /'
    done
    printf '  llama.cpp: '
    "$LLAMA_BIN/llama-bench" -m "$m" -ngl 99 -fa 1 -p 512 -n 128 -d "$DEPTHS" -r "$REPS" 2>&1 | grep -E "pp512|tg128" | tr '\n' ' '
    echo
done
t "done"
