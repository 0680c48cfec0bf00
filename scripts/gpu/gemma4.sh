#!/usr/bin/env bash
# Gemma 4 on the GPU (H200), in one call: ember's GPU path against its CPU path on tiny synthetic
# Gemma 4 files that keep the real head sizes (512 on global layers, 256 on sliding ones), and
# optionally against llama.cpp and at the real 26B-A4B shape.
#
#   1. kernels: kernels/tests/run-nvcc.sh (every kernels/*.hip compiled with nvcc, every harness
#      run: harness_attention checks head dims 256, 320 and 512 and Gemma 4's layer shapes against
#      its double-precision reference, harness_moe the combine with per-expert scales, harness
#      the bare RMS norm and the row broadcast), cubins placed where ember looks; meanwhile
#      ember-synth writes the models:
#        g4moe   gemma4-26b-a4b, 6 layers (5 sliding of head 256 with a window of 32, 1 global of
#                head 512 using K as V, proportional rope), 16 experts (4 used) with per-expert
#                scales beside the dense FFN;
#        g4e     gemma4-e2b, 10 layers (4 sliding + 1 global, twice), the last 5 reading the KV of
#                layers 3 and 4, per-layer embeddings of 64;
#      each in q8_0 and q4_k_m;
#   2. agreement: greedy `ember run --format json` ($N_TOKENS tokens, past the window and the
#      64-key decode partitions) of 3 prompts on the CPU and on the GPU, judged by
#      golden_rule.py ember (the CPU re-evaluates any parting); `ember perplexity` CPU vs GPU
#      within $PPL_TOLERANCE (-c 256, so prompts cross the sliding window in the prefill kernel);
#      `ember bench` on the GPU (it must run); graph statistics of a GPU run;
#   3. with LLAMA_BIN (a folder holding llama-perplexity and llama-bench): llama-perplexity of the
#      same files on its GPU path, for calibration;
#   4. with REAL=1: Gemma 4 26B-A4B at its real shape in Q4_K_M (ember-synth --fast, ~16 GB):
#      ember perplexity and ember bench on the GPU, beside llama.cpp when LLAMA_BIN is given.
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT EMBER=path/to/ember SYNTH=path/to/ember-synth scripts/gpu/gemma4.sh
# Environment: ARCH [sm_90], DEVICE [cuda:0], MODELS [/tmp/ember-gemma4], N_TOKENS [80],
# PPL_TOLERANCE [0.01], CPU_THREADS [8], LLAMA_BIN, REAL, KERNELS [1; 0 skips step 1's nvcc part
# and uses the cubins already in $EMBER_KERNELS_DIR; with DEVICE=cpu the script runs anywhere, to
# test itself]. Exits non-zero when a kernel harness, a GPU run or an agreement check failed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-gemma4}"
ARCH="${ARCH:-sm_90}"
DEVICE="${DEVICE:-cuda:0}"
N_TOKENS="${N_TOKENS:-80}"
PPL_TOLERANCE="${PPL_TOLERANCE:-0.01}"
CPU_THREADS="${CPU_THREADS:-8}"
RULE="$ROOT/scripts/gpu/golden_rule.py"
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
mkdir -p "$OUT" "$MODELS"
LOG="$OUT/gemma4.log"
: >"$LOG"
start=$SECONDS
failures=()
t() { echo "[t=$((SECONDS - start))s] $*" | tee -a "$LOG"; }
fail() {
    failures+=("$1")
    echo "FAIL $1" | tee -a "$LOG"
}
if [[ "$DEVICE" == cpu ]]; then GPU=(--device cpu -t "$CPU_THREADS"); else GPU=(--device "$DEVICE" -ngl 99); fi
CPU=(--device cpu -t "$CPU_THREADS")

t "kernels for $ARCH (compile and harnesses) while the models are written"
(
    [[ "${KERNELS:-1}" == 1 ]] || { : >"$OUT/gemma4-kernels.log"; exit 0; }
    build="$MODELS/kernels-build-$ARCH"
    rm -rf "$build"
    bash "$ROOT/kernels/tests/run-nvcc.sh" "$ARCH" "$build" >"$OUT/gemma4-kernels.log" 2>&1
    rc=$?
    mkdir -p "$EMBER_KERNELS_DIR/$ARCH"
    cp "$build"/*.cubin "$EMBER_KERNELS_DIR/$ARCH/" 2>/dev/null
    exit $rc
) &
kernels_pid=$!

# name shape type extra-flags...
synth() {
    local name="$1" shape="$2" ty="$3"
    shift 3
    "$SYNTH" --shape "$shape" --type "$ty" --seed 21 --vocab 2048 --embd 256 --heads 4 --head-dim 256 \
        --global-head-dim 512 --ff 512 --window 32 "$@" -o "$MODELS/$name-$ty.gguf" >>"$LOG" 2>&1 ||
        fail "ember-synth $name $ty"
}
MODEL_NAMES=()
for ty in q8_0 q4_k_m; do
    synth g4moe gemma4-26b-a4b "$ty" --layers 6 --kv-heads 2 --global-kv-heads 1 --experts 16 \
        --experts-used 4 --expert-ff 256
    synth g4e gemma4-e2b "$ty" --layers 10 --kv-heads 1 --global-kv-heads 1 --shared-kv-layers 5 \
        --per-layer-embd 64
    MODEL_NAMES+=("g4moe-$ty" "g4e-$ty")
done
if [[ "${REAL:-0}" == 1 ]]; then
    BIG="$MODELS/gemma4-26b-a4b-q4_k_m.gguf"
    [[ -s "$BIG" ]] || "$SYNTH" --shape gemma4-26b-a4b --type q4_k_m --fast -o "$BIG" >>"$LOG" 2>&1 ||
        fail "ember-synth gemma4-26b-a4b (real shape)"
fi
if ! wait "$kernels_pid"; then
    fail "kernels (see $OUT/gemma4-kernels.log)"
    grep -E "^FAIL|FAILED|run-nvcc.sh:" "$OUT/gemma4-kernels.log" | head -30
elif [[ -s "$OUT/gemma4-kernels.log" ]]; then
    grep -E "run-nvcc.sh:|^INFO attention .*d=512" "$OUT/gemma4-kernels.log"
fi
t "kernels and models ready"

TEXT="$MODELS/text.txt"
cat "$ROOT/tests/data/golden/gpl-3.txt" >"$TEXT" 2>/dev/null || cat "$ROOT/README.md" >"$TEXT"
PROMPTS=("The capital of France is" "Once upon a time, in a small village," "def quicksort(arr):")
dir="$MODELS/runs"
rm -rf "$dir"
mkdir -p "$dir"
cases="$dir/cases.tsv" ppl_cases="$dir/ppl.tsv"
: >"$cases"
: >"$ppl_cases"

t "agreement: greedy runs on the CPU (background) and the GPU"
cpu_jobs=()
for name in "${MODEL_NAMES[@]}"; do
    m="$MODELS/$name.gguf"
    [[ -s "$m" ]] || continue
    for i in "${!PROMPTS[@]}"; do
        base="$dir/$name.p$i"
        "$EMBER" run -m "$m" -p "${PROMPTS[$i]}" -n "$N_TOKENS" --temp 0 -c 512 --format json "${CPU[@]}" \
            >"$base.cpu.json" 2>"$base.cpu.err" &
        cpu_jobs+=($!)
        printf '%s\t%s\t%s\t%s\n' "$name/p$i" "$base.cpu.json" "$base.gpu.json" "$m" >>"$cases"
    done
done
for name in "${MODEL_NAMES[@]}"; do
    m="$MODELS/$name.gguf"
    [[ -s "$m" ]] || continue
    for i in "${!PROMPTS[@]}"; do
        base="$dir/$name.p$i"
        EMBER_LOG=info "$EMBER" run -m "$m" -p "${PROMPTS[$i]}" -n "$N_TOKENS" --temp 0 -c 512 --format json \
            "${GPU[@]}" >"$base.gpu.json" 2>"$base.gpu.err" ||
            { fail "GPU run $name p$i: $(tail -2 "$base.gpu.err" | tr '\n' ' ')"; }
    done
done
for pid in "${cpu_jobs[@]}"; do wait "$pid" || fail "a CPU run (see $dir/*.cpu.err)"; done
python3 "$RULE" ember --list "$cases" --reeval-ember "$EMBER" --reeval-device cpu \
    --max-logprob-diff 0.5 >"$dir/verdicts.txt" 2>&1 || fail "greedy CPU vs GPU (see $dir/verdicts.txt)"
cat "$dir/verdicts.txt" >>"$LOG"
grep -E "^(PASS|FAIL)|^golden_rule" "$dir/verdicts.txt"
echo "graph statistics of one GPU run (decode steps recorded as graphs; 'redone' counts aborted captures):"
grep -h -i -E "graph" "$dir/${MODEL_NAMES[0]}.p0.gpu.err" | tail -2

t "agreement: perplexity CPU vs GPU (-c 256, 4 chunks)"
for name in "${MODEL_NAMES[@]}"; do
    m="$MODELS/$name.gguf"
    [[ -s "$m" ]] || continue
    "$EMBER" perplexity -m "$m" -f "$TEXT" -c 256 --chunks 4 "${CPU[@]}" >"$dir/$name.ppl.cpu.txt" 2>>"$LOG" &
    cpu_pid=$!
    "$EMBER" perplexity -m "$m" -f "$TEXT" -c 256 --chunks 4 "${GPU[@]}" >"$dir/$name.ppl.gpu.txt" 2>>"$LOG" ||
        fail "GPU perplexity $name"
    wait "$cpu_pid" || fail "CPU perplexity $name"
    printf '%s\t%s\t%s\n' "$name/ppl" "$dir/$name.ppl.cpu.txt" "$dir/$name.ppl.gpu.txt" >>"$ppl_cases"
done
python3 "$RULE" ppl --list "$ppl_cases" --tolerance "$PPL_TOLERANCE" >"$dir/ppl-verdicts.txt" 2>&1 ||
    fail "perplexity CPU vs GPU (see $dir/ppl-verdicts.txt)"
cat "$dir/ppl-verdicts.txt" | tee -a "$LOG"

t "ember bench on the GPU (tiny models: it must run)"
for name in g4moe-q4_k_m g4e-q4_k_m; do
    m="$MODELS/$name.gguf"
    [[ -s "$m" ]] || continue
    echo "$name:"
    "$EMBER" bench -m "$m" "${GPU[@]}" -p 512 -n 128 -r 2 2>"$dir/$name.bench.err" | tail -3 || fail "GPU bench $name"
done

if [[ -n "${LLAMA_BIN:-}" ]]; then
    export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    t "calibration: llama-perplexity of the same files on its GPU path"
    for name in "${MODEL_NAMES[@]}"; do
        m="$MODELS/$name.gguf"
        [[ -s "$m" ]] || continue
        printf '%s llama.cpp -ngl 99: ' "$name"
        "$LLAMA_BIN/llama-perplexity" -m "$m" -f "$TEXT" -c 256 --chunks 4 -ngl 99 2>&1 | grep -E "Final estimate" | tail -1
        printf '%s ember GPU:          ' "$name"
        grep -E "Final estimate" "$dir/$name.ppl.gpu.txt" | tail -1
    done
fi

if [[ "${REAL:-0}" == 1 && -s "${BIG:-}" ]]; then
    t "26B-A4B (real shape): ember perplexity and bench on the GPU"
    "$EMBER" perplexity -m "$BIG" -f "$TEXT" -c 512 --chunks 4 "${GPU[@]}" 2>&1 | tail -2 || fail "GPU perplexity 26B-A4B"
    EMBER_LOG=info "$EMBER" bench -m "$BIG" "${GPU[@]}" -p 512 -n 128 -r 3 2>"$dir/bench-26b.err" | tail -4 ||
        fail "GPU bench 26B-A4B"
    grep -i -E "graph|warn" "$dir/bench-26b.err" | head -5
    if [[ -n "${LLAMA_BIN:-}" ]]; then
        "$LLAMA_BIN/llama-perplexity" -m "$BIG" -f "$TEXT" -c 512 --chunks 4 -ngl 99 2>&1 | grep -E "Final estimate" | tail -1
        "$LLAMA_BIN/llama-bench" -m "$BIG" -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | tail -6
    fi
fi

if ((${#failures[@]})); then
    t "done: ${#failures[@]} failure(s):"
    printf '  %s\n' "${failures[@]}"
    exit 1
fi
t "done: every check passed"
