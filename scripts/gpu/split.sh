#!/usr/bin/env bash
# Partial offload on the GPU (H200): an 8B Q4_K_M model with its last N layers on the GPU and the
# rest on the CPU, for N in $NGL_LIST, ember beside llama.cpp at the same -ngl.
#
#   for each -ngl: `ember bench -p 512 -n 128` and `llama-bench -p 512 -n 128` on the same file
#   (medians of $REPS runs), greedy `ember run --format json` judged against the CPU run by
#   golden_rule.py (the CPU re-evaluates any parting), and ember's memory report (--memory-report:
#   per device, by purpose). Ends with one table: -ngl, ember pp512/tg128, llama.cpp pp512/tg128,
#   the ratio, the greedy verdict.
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT EMBER=path/to/ember SYNTH=path/to/ember-synth LLAMA_BIN=folder scripts/gpu/split.sh
# MODEL: a GGUF to use instead of a synthetic llama3-8b:q4_k_m; NGL_LIST (default 0 8 16 24 32);
# N_TOKENS greedy tokens (default 64); REPS bench repetitions (default 3).
# Prints figures and verdicts; asserts nothing about speed.
#
# State of ember at the time of writing: layer splits run over simulated devices
# (`--device sim:0,...`, the CPU's ops) and -ngl 0 / full offload run on the GPU; a CPU + GPU
# split on a real GPU is not built yet, so ember refuses `-ngl` between 1 and the layer count on
# cuda:0 (its message is in ember-N.err and the table shows "-") while llama.cpp's row is filled.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-split}"
ARCH="${ARCH:-sm_90}"
REPS="${REPS:-3}"
N_TOKENS="${N_TOKENS:-64}"
NGL_LIST="${NGL_LIST:-0 8 16 24 32}"
LLAMA_BIN="${LLAMA_BIN:?LLAMA_BIN: a folder with llama-bench}"
RULE="$ROOT/scripts/gpu/golden_rule.py"
PROMPT="${PROMPT:-The history of the printing press begins}"
export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
mkdir -p "$OUT" "$MODELS"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }
# The mean tokens/s of a test's row in a bench table (`| ... | pp512 | 1234.56 ± 3.21 | ...`: both
# ember bench and llama-bench write it so).
rate() { grep -E "\| $1 " | grep -oE '[0-9]+(\.[0-9]+)? ±' | head -1 | cut -d' ' -f1; }

if [[ ! -d "$EMBER_KERNELS_DIR/$ARCH" ]]; then
    t "kernels for $ARCH"
    mkdir -p "$EMBER_KERNELS_DIR/$ARCH"
    ls "$ROOT"/kernels/*.hip | xargs -P 8 -I{} sh -c \
        'nvcc -cubin -arch="$1" -O3 -std=c++17 -x cu -I "$2/kernels" -o "$3/$(basename "$4" .hip).cubin" "$4" || echo "FAILED $4"' \
        _ "$ARCH" "$ROOT" "$EMBER_KERNELS_DIR/$ARCH" {} >"$OUT/kernels-split.log" 2>&1
    if grep -q FAILED "$OUT/kernels-split.log"; then
        grep -A10 FAILED "$OUT/kernels-split.log" | head -40
        exit 1
    fi
fi
m="${MODEL:-$MODELS/llama3-8b-q4_k_m.gguf}"
if [[ ! -s "$m" ]]; then
    t "ember-synth llama3-8b q4_k_m"
    "$SYNTH" --shape llama3-8b --type q4_k_m --fast -o "$m" >>"$OUT/synth-split.log" 2>&1 ||
        { t "ember-synth failed (see $OUT/synth-split.log)"; exit 1; }
fi
dir="$OUT/split"
mkdir -p "$dir"
t "greedy reference on the CPU"
"$EMBER" run -m "$m" -p "$PROMPT" -n "$N_TOKENS" --temp 0 -c 512 --format json --device cpu \
    >"$dir/cpu.json" 2>"$dir/cpu.err" || t "CPU run failed: $(tail -2 "$dir/cpu.err" | tr '\n' ' ')"
table="$dir/table.txt"
printf '%-5s %12s %12s %12s %12s %8s %8s  %s\n' -ngl "ember pp512" "ember tg128" "llama pp512" \
    "llama tg128" "pp x" "tg x" greedy >"$table"
for ngl in $NGL_LIST; do
    t "-ngl $ngl"
    EMBER_LOG=info "$EMBER" bench -m "$m" --device cuda:0 -ngl "$ngl" -p 512 -n 128 -r "$REPS" \
        >"$dir/ember-$ngl.txt" 2>"$dir/ember-$ngl.err" || t "  ember bench: $(tail -1 "$dir/ember-$ngl.err")"
    "$LLAMA_BIN/llama-bench" -m "$m" -ngl "$ngl" -p 512 -n 128 -r "$REPS" >"$dir/llama-$ngl.txt" 2>&1 ||
        t "  llama-bench failed (see $dir/llama-$ngl.txt)"
    "$EMBER" run -m "$m" -p "$PROMPT" -n "$N_TOKENS" --temp 0 -c 512 --format json --device cuda:0 \
        -ngl "$ngl" --memory-report >"$dir/gpu-$ngl.json" 2>"$dir/gpu-$ngl.err" ||
        t "  ember run: $(tail -1 "$dir/gpu-$ngl.err")"
    echo "  memory report:"
    grep -iE "memory|weights|kv|scratch|cuda:|cpu" "$dir/gpu-$ngl.err" | tail -12 | sed 's/^/    /'
    printf '%s\t%s\t%s\t%s\n' "ngl$ngl" "$dir/cpu.json" "$dir/gpu-$ngl.json" "$m" >"$dir/case-$ngl.tsv"
    verdict=$(python3 "$RULE" ember --list "$dir/case-$ngl.tsv" --reeval-ember "$EMBER" --reeval-device cpu \
        2>&1 | grep -E "^(PASS|FAIL)" | head -1 | cut -d' ' -f1)
    ep=$(rate pp512 <"$dir/ember-$ngl.txt") et=$(rate tg128 <"$dir/ember-$ngl.txt")
    lp=$(rate pp512 <"$dir/llama-$ngl.txt") lt=$(rate tg128 <"$dir/llama-$ngl.txt")
    ratio() { [[ -n "$1" && -n "$2" ]] && python3 -c "print(f'{$1/$2:.2f}')" || echo -; }
    printf '%-5s %12s %12s %12s %12s %8s %8s  %s\n' "$ngl" "${ep:--}" "${et:--}" "${lp:--}" "${lt:--}" \
        "$(ratio "$ep" "$lp")" "$(ratio "$et" "$lt")" "${verdict:-none}" >>"$table"
done
echo
cat "$table"
t "done"
