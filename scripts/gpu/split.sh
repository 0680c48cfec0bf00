#!/usr/bin/env bash
# Partial offload on the GPU (H200), issue 15: an 8B Q4_K_M model with its last N layers on the GPU
# and the rest on the CPU, for N in $NGL_LIST, ember beside llama.cpp at the same -ngl, in one call
# (under 8 minutes on the H200 with the defaults).
#
#   llama.cpp builds in the background from a carried source tarball (LLAMA_SRC, as
#   scripts/gpu/side_by_side.sh takes it) while ember's kernels compile, the model is written
#   and ember's greedy runs go: for each -ngl, `ember run --temp 0 --memory-report` on cuda:0
#   judged against the CPU run by golden_rule.py (the CPU re-evaluates any parting), with the
#   load plan (layers and bytes per device) and the memory report. Once llama.cpp is built, at
#   each -ngl `ember bench -p 512 -n 128` and `llama-bench -p 512 -n 128` on the same file, one
#   after the other. Ends with one table: -ngl, ember pp512/tg128, llama.cpp pp512/tg128, the
#   ratios, the greedy verdict. Before the benches, one check in reference numerics: the split
#   at -ngl $REF_NGL with -t 2 gives the CPU's tokens exactly ("reference: PASS").
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT LLAMA_SRC=llama-src.tgz EMBER=path/to/ember SYNTH=path/to/ember-synth \
#       scripts/gpu/split.sh
# LLAMA_BIN: a folder with llama-bench instead of LLAMA_SRC. MODEL: a GGUF to use instead of a
# synthetic llama3-8b:q4_k_m; NGL_LIST (default 0 8 16 24 32); N_LAYERS the model's layers (32);
# N_TOKENS greedy tokens (default 64); REPS bench repetitions (default 1: the CPU-heavy settings
# are slow); BENCH_P and BENCH_N the bench's prompt and generated tokens (default 512 and 128);
# BEFORE_LLAMA a command run once before the first llama.cpp step (with LLAMA_BIN: to wait for a
# build that the caller started).
# Prints figures and verdicts; asserts nothing about speed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-split}"
W="${WORK:-${TMPDIR:-/tmp}/ember-split-llama}"
ARCH="${ARCH:-sm_90}"
REPS="${REPS:-1}"
BENCH_P="${BENCH_P:-512}"
BENCH_N="${BENCH_N:-128}"
N_TOKENS="${N_TOKENS:-64}"
NGL_LIST="${NGL_LIST:-0 8 16 24 32}"
N_LAYERS="${N_LAYERS:-32}"
RULE="$ROOT/scripts/gpu/golden_rule.py"
PROMPT="${PROMPT:-The history of the printing press begins}"
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
mkdir -p "$OUT" "$MODELS"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }
# The mean tokens/s of a test's row in a bench table (`| ... | pp512 | 1234.56 ± 3.21 | ...`: both
# ember bench and llama-bench write it so).
rate() { grep -E "\|[[:space:]]+$1[[:space:]]" | grep -oE '[0-9]+(\.[0-9]+)? ±' | head -1 | cut -d' ' -f1; }

llama_build=
if [[ -z "${LLAMA_BIN:-}" ]]; then
    [[ -n "${LLAMA_SRC:-}" ]] || { echo "LLAMA_SRC (a tarball holding llama.cpp/) or LLAMA_BIN is needed"; exit 1; }
    LLAMA_BIN="$W/build/bin"
    mkdir -p "$W"
    (cd "$W" && tar xzf "$LLAMA_SRC" &&
        cmake -S llama.cpp -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DLLAMA_CURL=OFF \
            -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF >/dev/null &&
        cmake --build build -j 12 --target llama-bench) >"$OUT/llama-build-split.log" 2>&1 &
    llama_build=$!
fi

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
# ember refuses -ngl 0 with --device cuda:0 (no layer would be on the GPU): -ngl 0 is the CPU.
dev() { if [[ "$1" == 0 ]]; then echo cpu; else echo cuda:0; fi; }
verdicts=()
for ngl in $NGL_LIST; do
    t "-ngl $ngl: greedy"
    "$EMBER" run -m "$m" -p "$PROMPT" -n "$N_TOKENS" --temp 0 -c 512 --format json --device "$(dev "$ngl")" \
        -ngl "$ngl" --memory-report >"$dir/gpu-$ngl.json" 2>"$dir/gpu-$ngl.err" ||
        t "  ember run: $(tail -1 "$dir/gpu-$ngl.err")"
    echo "  load plan and memory report:"
    grep -iE "plan|layers|memory|weights|kv|scratch|cuda:|cpu" "$dir/gpu-$ngl.err" | tail -24 | sed 's/^/    /'
    printf '%s\t%s\t%s\t%s\n' "ngl$ngl" "$dir/cpu.json" "$dir/gpu-$ngl.json" "$m" >"$dir/case-$ngl.tsv"
    verdict=$(python3 "$RULE" ember --list "$dir/case-$ngl.tsv" --reeval-ember "$EMBER" --reeval-device cpu \
        2>&1 | grep -E "^(PASS|FAIL)" | head -1 | cut -d' ' -f1)
    verdicts+=("${verdict:-none}")
    t "  greedy against the CPU: ${verdict:-none}"
done
# Reference numerics: every GPU op bit-identical to the CPU at EMBER_REFERENCE_THREADS (2), so a
# CPU + GPU split run with -t 2 must give the very tokens of the CPU run with -t 2.
REF_NGL="${REF_NGL:-16}" REF_TOKENS="${REF_TOKENS:-16}"
t "-ngl $REF_NGL in reference numerics against the CPU, -t 2, $REF_TOKENS tokens"
"$EMBER" run -m "$m" -p "$PROMPT" -n "$REF_TOKENS" --temp 0 -c 512 --format json --device cpu -t 2 \
    >"$dir/cpu-ref.json" 2>"$dir/cpu-ref.err" || t "  CPU run: $(tail -1 "$dir/cpu-ref.err")"
"$EMBER" run -m "$m" -p "$PROMPT" -n "$REF_TOKENS" --temp 0 -c 512 --format json --device cuda:0 -t 2 \
    -ngl "$REF_NGL" --numerics reference >"$dir/gpu-ref.json" 2>"$dir/gpu-ref.err" ||
    t "  GPU run: $(tail -1 "$dir/gpu-ref.err")"
python3 - "$dir/cpu-ref.json" "$dir/gpu-ref.json" <<'PY'
import json, sys
try:
    cpu, gpu = (json.load(open(p))["tokens"] for p in sys.argv[1:])
except Exception as e:
    print(f"  reference: FAIL (no tokens: {e})")
    sys.exit(0)
same = cpu == gpu and len(cpu) > 0
print(f"  reference: {'PASS' if same else 'FAIL'}: {len(cpu)} CPU tokens, {len(gpu)} split tokens, identical: {same}")
PY
if [[ -n "$llama_build" ]]; then
    wait "$llama_build" || { tail -20 "$OUT/llama-build-split.log"; exit 1; }
    t "llama.cpp built"
fi
if [[ -n "${BEFORE_LLAMA:-}" ]]; then
    bash -c "$BEFORE_LLAMA" || { t "BEFORE_LLAMA failed: $BEFORE_LLAMA"; exit 1; }
fi
export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
table="$dir/table.txt"
printf '%-5s %12s %12s %12s %12s %8s %8s  %s\n' -ngl "ember pp$BENCH_P" "ember tg$BENCH_N" \
    "llama pp$BENCH_P" "llama tg$BENCH_N" "pp x" "tg x" greedy >"$table"
i=0
for ngl in $NGL_LIST; do
    t "-ngl $ngl: benches"
    "$EMBER" bench -m "$m" --device "$(dev "$ngl")" -ngl "$ngl" -p "$BENCH_P" -n "$BENCH_N" -r "$REPS" \
        >"$dir/ember-$ngl.txt" 2>"$dir/ember-$ngl.err" || t "  ember bench: $(tail -1 "$dir/ember-$ngl.err")"
    # llama.cpp counts the output layer as one more: -ngl N_LAYERS leaves it on the CPU, while
    # ember puts it on the GPU once every layer is there; 99 gives llama.cpp the same placement.
    lngl=$ngl
    ((ngl >= N_LAYERS)) && lngl=99
    "$LLAMA_BIN/llama-bench" -m "$m" -ngl "$lngl" -fa 1 -p "$BENCH_P" -n "$BENCH_N" -r "$REPS" >"$dir/llama-$ngl.txt" 2>&1 ||
        t "  llama-bench failed (see $dir/llama-$ngl.txt)"
    ep=$(rate "pp$BENCH_P" <"$dir/ember-$ngl.txt") et=$(rate "tg$BENCH_N" <"$dir/ember-$ngl.txt")
    lp=$(rate "pp$BENCH_P" <"$dir/llama-$ngl.txt") lt=$(rate "tg$BENCH_N" <"$dir/llama-$ngl.txt")
    ratio() { [[ -n "$1" && -n "$2" ]] && python3 -c "print(f'{$1/$2:.2f}')" || echo -; }
    printf '%-5s %12s %12s %12s %12s %8s %8s  %s\n' "$ngl" "${ep:--}" "${et:--}" "${lp:--}" "${lt:--}" \
        "$(ratio "$ep" "$lp")" "$(ratio "$et" "$lt")" "${verdicts[$i]}" >>"$table"
    i=$((i + 1))
done
echo
cat "$table"
t "done"
