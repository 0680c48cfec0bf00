#!/usr/bin/env bash
# Mixture of experts on the GPU (H200), in one call: ember's GPU path against its CPU path and
# against llama.cpp on the same files.
#
#   1. kernels (nvcc, sm_90) while ember-synth writes the models: a tiny qwen3moe (the reference
#      test's shape, q8_0), a small one with k-quant experts (q4_K_M mix: q4_K and q6_K), and
#      Qwen3-30B-A3B at its real shape in Q4_K_M;
#   2. agreement: `ember perplexity` of the tiny and small models on the CPU and on the GPU over
#      the same text, and of the 30B model on the GPU beside `llama-perplexity` on the same file;
#      `ember run --temp 0` on CPU and GPU (the same tokens are expected where logits do not tie);
#   3. speed: `ember bench` against `llama-bench`, pp512 and tg128, on the 30B model;
#   4. memory: `ember run --memory-report` on the 30B model (post-load floor after idle).
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT EMBER=path/to/ember SYNTH=path/to/ember-synth LLAMA_BIN=folder scripts/gpu/moe.sh
# LLAMA_BIN holds llama-bench and llama-perplexity with their libraries (built from source in an
# earlier call, as scripts/gpu/serve.sh does). Prints figures; asserts nothing about speed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-moe}"
ARCH="${ARCH:-sm_90}"
LLAMA_BIN="${LLAMA_BIN:?LLAMA_BIN: a folder with llama-bench and llama-perplexity}"
export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
mkdir -p "$OUT" "$MODELS"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }

t "kernels for $ARCH, models"
(mkdir -p "$EMBER_KERNELS_DIR/$ARCH"
 ls "$ROOT"/kernels/*.hip | xargs -P 8 -I{} sh -c \
     'nvcc -cubin -arch="$1" -O3 -std=c++17 -x cu -I "$2/kernels" -o "$3/$(basename "$4" .hip).cubin" "$4" || echo "FAILED $4"' \
     _ "$ARCH" "$ROOT" "$EMBER_KERNELS_DIR/$ARCH" {} >"$OUT/kernels.log" 2>&1
 ! grep -q FAILED "$OUT/kernels.log") &
kernels_pid=$!
TINY="$MODELS/qwen3moe-tiny-q8_0.gguf"
SMALL="$MODELS/qwen3moe-small-q4_k_m.gguf"
BIG="$MODELS/qwen3-30b-a3b-q4_k_m.gguf"
"$SYNTH" --shape qwen3-30b-a3b --type q8_0 --seed 11 --layers 3 --vocab 1024 --embd 128 --heads 8 \
    --kv-heads 1 --head-dim 64 --expert-ff 32 -o "$TINY" >"$OUT/synth.log" 2>&1
"$SYNTH" --shape qwen3-30b-a3b --type q4_k_m --seed 12 --layers 4 --vocab 4096 --embd 512 --heads 8 \
    --kv-heads 2 --head-dim 64 --expert-ff 256 -o "$SMALL" >>"$OUT/synth.log" 2>&1
[[ -s "$BIG" ]] || "$SYNTH" --shape qwen3-30b-a3b --type q4_k_m --fast -o "$BIG" >>"$OUT/synth.log" 2>&1
wait "$kernels_pid" || { t "kernels failed"; grep -B2 -A10 FAILED "$OUT/kernels.log" | head -40; exit 1; }
t "kernels and models ready"

TEXT="$MODELS/text.txt"
cat "$ROOT"/README.md "$ROOT"/../shared/DESIGN.md 2>/dev/null >"$TEXT" || cat "$ROOT"/README.md >"$TEXT"
GPU=(--device cuda:0 -ngl 99)

t "agreement: perplexity, CPU and GPU"
for m in "$TINY" "$SMALL"; do
    for dev in cpu gpu; do
        if [[ $dev == cpu ]]; then flags=(--device cpu -t 16); else flags=("${GPU[@]}"); fi
        printf '%s %s: ' "$(basename "$m")" "$dev"
        "$EMBER" perplexity -m "$m" -f "$TEXT" -c 256 --chunks 8 "${flags[@]}" 2>&1 | grep -i -E "perplexity|PPL|error" | tail -2 | tr '\n' ' '
        echo
    done
    for dev in cpu gpu; do
        if [[ $dev == cpu ]]; then flags=(--device cpu -t 16); else flags=("${GPU[@]}"); fi
        "$EMBER" run -m "$m" -p "The experts of this layer" -n 48 --temp 0 "${flags[@]}" >"$OUT/run-$(basename "$m" .gguf)-$dev.txt" 2>"$OUT/run-$(basename "$m" .gguf)-$dev.err"
    done
    if cmp -s "$OUT/run-$(basename "$m" .gguf)-cpu.txt" "$OUT/run-$(basename "$m" .gguf)-gpu.txt"; then
        echo "$(basename "$m"): greedy output identical on CPU and GPU (48 tokens)"
    else
        echo "$(basename "$m"): greedy output differs between CPU and GPU:"; head -c 400 "$OUT/run-$(basename "$m" .gguf)-cpu.txt"; echo; head -c 400 "$OUT/run-$(basename "$m" .gguf)-gpu.txt"; echo
        tail -3 "$OUT/run-$(basename "$m" .gguf)-gpu.err"
    fi
done

t "calibration: llama-perplexity of the same small models on its CPU and GPU paths"
for m in "$TINY" "$SMALL"; do
    for ngl in 0 99; do
        printf '%s llama.cpp -ngl %s: ' "$(basename "$m")" "$ngl"
        "$LLAMA_BIN/llama-perplexity" -m "$m" -f "$TEXT" -c 256 --chunks 8 -ngl "$ngl" -t 16 2>&1 | grep -E "Final estimate" | tail -1
    done
done

t "30B-A3B: ember perplexity (GPU) beside llama-perplexity"
"$EMBER" perplexity -m "$BIG" -f "$TEXT" -c 512 --chunks 8 "${GPU[@]}" 2>&1 | tail -3
"$LLAMA_BIN/llama-perplexity" -m "$BIG" -f "$TEXT" -c 512 --chunks 8 -ngl 99 2>&1 | grep -E "Final estimate|\[[0-9]+\]" | tail -3

t "30B-A3B: speed, ember bench and llama-bench"
EMBER_LOG=info "$EMBER" bench -m "$BIG" "${GPU[@]}" -p 512 -n 128 -r 3 2>"$OUT/bench-ember.err" | tail -4
grep -i -E "graph|warn" "$OUT/bench-ember.err" | head -5
"$LLAMA_BIN/llama-bench" -m "$BIG" -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | tail -6

t "30B-A3B: memory report"
"$EMBER" run -m "$BIG" "${GPU[@]}" -p "Memory after a burst" -n 32 --temp 0 --memory-report 2>&1 | grep -i -E "memory|floor|held|weights|kv|scratch" | head -20
t "done"
