#!/usr/bin/env bash
# How sensitive a synthetic model is, as the yardstick for the GPU's KLD figures (scripts/gpu/kld.sh,
# scripts/gpu/models_side_by_side.sh): llama.cpp's own CPU run of the model written in F16 is the
# base, and the same weights written in Q8_0 (a rounding that llama.cpp's users treat as lossless)
# are compared against it with `llama-perplexity --kl-divergence`. A fast path whose KLD against
# the CPU is below this figure drifts less than Q8_0 rounding of the weights does on that model.
# CPU only: runs on any machine with a llama.cpp build (the `vendor/llama.cpp` folder of the
# llama-cpp-python sdist, built with cmake; never committed).
#
# Usage: LLAMA_BIN=dir/with/llama-perplexity SYNTH=path/to/ember-synth scripts/kld_yardstick.sh
# Knobs: SHAPES ("shape:layers ..."), CTX, CHUNKS, THREADS, WORK (scratch; models are deleted).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LLAMA_BIN="${LLAMA_BIN:?LLAMA_BIN: a folder with llama-perplexity}"
SYNTH="${SYNTH:?SYNTH: the ember-synth binary}"
SHAPES="${SHAPES:-qwen3-0.6b:4 qwen3-30b-a3b:2 gemma4-26b-a4b:2}"
CTX="${CTX:-256}"
CHUNKS="${CHUNKS:-4}"
THREADS="${THREADS:-$(nproc)}"
TEXT="${TEXT:-$ROOT/tests/data/golden/gpl-3.txt}"
W="${WORK:-${TMPDIR:-/tmp}/ember-kld-yardstick}"
mkdir -p "$W"
export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
rows=()
for entry in $SHAPES; do
    shape="${entry%%:*}" layers="${entry##*:}"
    for ty in f16 q8_0; do
        "$SYNTH" --shape "$shape" --type "$ty" --pure --layers "$layers" -o "$W/$shape-$ty.gguf" >/dev/null 2>&1 ||
            { echo "$shape $ty: ember-synth failed" >&2; status=1; continue 2; }
    done
    "$LLAMA_BIN/llama-perplexity" -m "$W/$shape-f16.gguf" -f "$TEXT" -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" \
        --kl-divergence-base "$W/base.kld" >"$W/$shape-base.log" 2>&1 &&
        "$LLAMA_BIN/llama-perplexity" -m "$W/$shape-q8_0.gguf" -t "$THREADS" --kl-divergence-base "$W/base.kld" \
            --kl-divergence >"$W/$shape-q8_0.log" 2>&1 ||
        { echo "$shape: llama-perplexity failed (logs in $W)" >&2; status=1; }
    rm -f "$W/$shape-f16.gguf" "$W/$shape-q8_0.gguf" "$W/base.kld"
    mean=$(awk '/^Mean +KLD:/ { print $3 }' "$W/$shape-q8_0.log")
    p99=$(awk '/^99.0% +KLD:/ { print $3 }' "$W/$shape-q8_0.log")
    top=$(awk '/^Same top p:/ { print $4 }' "$W/$shape-q8_0.log")
    [[ -n "$mean" && -n "$top" ]] || { echo "$shape: no KLD lines in $W/$shape-q8_0.log" >&2; status=1; continue; }
    rows+=("| $shape | $layers | $mean | $p99 | $top % |")
done
echo "llama.cpp CPU, Q8_0 weights against F16 weights of the same synthetic model, $CHUNKS x $CTX tokens:"
echo "| shape | layers | mean KLD | KLD 99% | same top token |"
echo "| --- | ---: | ---: | ---: | ---: |"
printf '%s\n' "${rows[@]}"
exit $status
