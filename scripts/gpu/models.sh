#!/usr/bin/env bash
# The models of issue 11 at their real shapes on the GPU (H200), in one call, against llama.cpp
# built from source reading the same files:
#
#   1. kernels (nvcc) while ember-synth writes each model (random weights, real shape, --fast);
#   2. agreement: `llama-perplexity --kl-divergence-base` over the same $KLD_TOKENS tokens of
#      text on llama.cpp's GPU path, then `ember perplexity --kl-divergence` on ember's GPU path
#      against that base file (mean/median/99% KLD, top-1 agreement, delta p);
#   3. speed: `ember bench` against `llama-bench`, pp512 and tg128, medians of $REPS runs;
#   4. memory: `ember run --memory-report` (where weights, KV and recurrent state live, and the
#      floor after idle).
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT EMBER=path/to/ember SYNTH=path/to/ember-synth LLAMA_BIN=folder \
#       SHAPES="qwen3-30b-a3b gemma4-26b-a4b" scripts/gpu/models.sh
# LLAMA_BIN holds llama-bench and llama-perplexity with their libraries (built from source in an
# earlier call, as scripts/gpu/serve.sh does). Each model file is deleted after its turn (the
# machine's disk holds about three). Prints figures; asserts nothing about speed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-models}"
ARCH="${ARCH:-sm_90}"
SHAPES="${SHAPES:-qwen3-30b-a3b}"
TYPE="${TYPE:-q4_k_m}"
REPS="${REPS:-3}"
CTX="${CTX:-512}"
KLD_TOKENS="${KLD_TOKENS:-4096}"
LLAMA_BIN="${LLAMA_BIN:?LLAMA_BIN: a folder with llama-bench and llama-perplexity}"
export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
mkdir -p "$OUT" "$MODELS"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }

kernels_pid=
if [[ ! -d "$EMBER_KERNELS_DIR/$ARCH" ]]; then
    t "kernels for $ARCH"
    mkdir -p "$EMBER_KERNELS_DIR/$ARCH"
    ls "$ROOT"/kernels/*.hip | xargs -P 8 -I{} sh -c \
        'nvcc -cubin -arch="$1" -O3 -std=c++17 -x cu -I "$2/kernels" -o "$3/$(basename "$4" .hip).cubin" "$4" || echo "FAILED $4"' \
        _ "$ARCH" "$ROOT" "$EMBER_KERNELS_DIR/$ARCH" {} >"$OUT/kernels.log" 2>&1 &
    kernels_pid=$!
fi

# Text: the GPL (tests/data/golden), then the README, repeated until long enough for the
# requested tokens whatever the tokenizer.
TEXT="$MODELS/text.txt"
: >"$TEXT"
for _ in 1 2 3 4; do cat "$ROOT"/tests/data/golden/gpl-3.txt "$ROOT"/README.md >>"$TEXT"; done
CHUNKS=$((KLD_TOKENS / CTX))
GPU=(--device cuda:0 -ngl 99)

model_for() { echo "$MODELS/$1-$TYPE.gguf"; }
synth() {
    local m
    m="$(model_for "$1")"
    [[ -s "$m" ]] || "$SYNTH" --shape "$1" --type "$TYPE" --fast -o "$m" >>"$OUT/synth-$1.log" 2>&1
}

shapes=($SHAPES)
synth "${shapes[0]}" &
synth_pid=$!
[[ -z "$kernels_pid" ]] || wait "$kernels_pid" 2>/dev/null
if grep -q FAILED "$OUT/kernels.log" 2>/dev/null; then
    t "kernels failed"
    grep -A10 FAILED "$OUT/kernels.log" | head -40
    exit 1
fi
for i in "${!shapes[@]}"; do
    shape="${shapes[$i]}"
    m="$(model_for "$shape")"
    wait "$synth_pid" || { t "$shape: ember-synth failed"; tail -5 "$OUT/synth-$shape.log"; continue; }
    # The next model is written while this one is measured.
    next="${shapes[$((i + 1))]:-}"
    if [[ -n "$next" ]]; then
        synth "$next" &
        synth_pid=$!
    fi
    t "$shape ($TYPE, $(du -h "$m" | cut -f1)): KLD, llama.cpp GPU as the base, $CHUNKS x $CTX tokens"
    base="$MODELS/$shape.kld"
    "$LLAMA_BIN/llama-perplexity" -m "$m" -f "$TEXT" -c "$CTX" --chunks "$CHUNKS" -ngl 99 -fa on \
        --kl-divergence-base "$base" >"$OUT/llama-ppl-$shape.log" 2>&1
    grep -E "Final estimate" "$OUT/llama-ppl-$shape.log" | sed 's/^/  llama.cpp: /'
    "$EMBER" perplexity -m "$m" "${GPU[@]}" --kl-divergence-base "$base" --kl-divergence \
        >"$OUT/ember-kld-$shape.log" 2>&1
    sed 's/^/  ember: /' "$OUT/ember-kld-$shape.log" | grep -v -i "loading\|progress" | tail -16

    t "$shape: speed (pp512, tg128, $REPS runs each)"
    EMBER_LOG=info "$EMBER" bench -m "$m" "${GPU[@]}" -p 512 -n 128 -r "$REPS" \
        2>"$OUT/bench-ember-$shape.err" | tail -4
    grep -i -E "graph steps|warn" "$OUT/bench-ember-$shape.err" | head -3
    "$LLAMA_BIN/llama-bench" -m "$m" -ngl 99 -fa 1 -p 512 -n 128 -r "$REPS" 2>&1 | grep -E "^\|" | tail -3

    t "$shape: memory report"
    "$EMBER" run -m "$m" "${GPU[@]}" -p "Memory after a burst" -n 32 --temp 0 --memory-report 2>&1 |
        grep -i -E "memory|floor|held|weights|kv|state|scratch" | head -20
    rm -f "$m"
done
t "done"
