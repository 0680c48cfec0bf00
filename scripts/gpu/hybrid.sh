#!/usr/bin/env bash
# Qwen 3.5 / 3.6 hybrids (qwen35, qwen35moe) on the GPU (H200), in one call: the delta-net
# kernel harness, then ember's GPU path against its CPU path on tiny synthetic models.
#
#   1. kernels: every kernels/*.hip compiled with nvcc into $EMBER_KERNELS_DIR/$ARCH while
#      ember-synth writes the models; kernels/tests/harness_delta_net.cu built and run (every
#      delta-net kernel against a scalar reference, and launch times at Qwen 3.5 27B's shape);
#   2. models: the two tiny hybrids of the reference-logit tests (linear heads of 32: the general
#      delta-rule kernel) and two at the real head sizes (linear heads of 128: the register
#      kernels; 4 layers, small vocabulary), q8_0 and q4_k_m;
#   3. greedy `ember run --format json` on the CPU and the GPU, judged by golden_rule.py ember
#      (tokens equal up to a parting explained by a near tie, log-probabilities within 0.5 nats),
#      and the GPU with decode graphs off (EMBER_GPU_GRAPHS=0) against the GPU with them on: the
#      tokens must be identical (a graph that updated the recurrent state twice, or not at all,
#      would part at once);
#   4. `ember perplexity` CPU vs GPU within PPL_TOLERANCE (golden_rule.py ppl);
#   5. `ember stress --parallel 16` on the GPU (16 sequences decoding at once, mixed prompt
#      lengths, states made and freed per sequence) with its memory report: device memory must
#      come back to the post-load floor (stress fails otherwise); and `ember bench` pp512/tg128.
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT EMBER=path/to/ember SYNTH=path/to/ember-synth scripts/gpu/hybrid.sh
# Environment: ARCH [sm_90], MODELS [/tmp/ember-hybrid], N_TOKENS [32], PPL_CHUNKS [4],
#   PPL_TOLERANCE [0.01], MAX_LOGPROB_DIFF [0.5], BIG=1 also writes Qwen3.5-35B-A3B at its real
#   shape (q4_k_m, about 20 GiB) and benches it.
# Exit status: non-zero when the harness, a consistency check, stress or a run failed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-hybrid}"
ARCH="${ARCH:-sm_90}"
N_TOKENS="${N_TOKENS:-32}"
PPL_CHUNKS="${PPL_CHUNKS:-4}"
RULE="$ROOT/scripts/gpu/golden_rule.py"
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
mkdir -p "$OUT" "$MODELS" "$EMBER_KERNELS_DIR/$ARCH"
start=$SECONDS
failures=()
t() { echo "[t=$((SECONDS - start))s] $*"; }
fail() {
    echo "FAIL: $*"
    failures+=("$*")
}

t "kernels for $ARCH and the delta-net harness, models"
(ls "$ROOT"/kernels/*.hip | xargs -P 8 -I{} sh -c \
    'nvcc -cubin -arch="$1" -O3 -std=c++17 -x cu -I "$2/kernels" -o "$3/$(basename "$4" .hip).cubin" "$4" || echo "FAILED $4"' \
    _ "$ARCH" "$ROOT" "$EMBER_KERNELS_DIR/$ARCH" {} >"$OUT/hybrid-kernels.log" 2>&1
 nvcc -std=c++17 -O2 -arch="$ARCH" -x cu -I "$ROOT/kernels" "$ROOT/kernels/tests/harness_delta_net.cu" \
     -o "$MODELS/harness_delta_net" >>"$OUT/hybrid-kernels.log" 2>&1 || echo "FAILED harness build"
 ! grep -q FAILED "$OUT/hybrid-kernels.log") &
kernels_pid=$!

TINY=(--layers 4 --vocab 1024 --embd 128 --heads 4 --kv-heads 1 --head-dim 64 --linear-k-heads 2 --linear-v-heads 4 --linear-head-dim 32)
declare -A MODEL_ARGS=(
    [qwen35-tiny-q8_0]="--shape qwen3.5-27b --type q8_0 --seed 12 ${TINY[*]} --ff 256"
    [qwen35moe-tiny-q8_0]="--shape qwen3.5-35b-a3b --type q8_0 --seed 13 ${TINY[*]} --experts 16 --experts-used 4 --expert-ff 32 --shared-ff 64"
    [qwen35-hd128-q4_k_m]="--shape qwen3.5-27b --type q4_k_m --seed 14 --layers 4 --vocab 4096 --fast"
    [qwen35moe-hd128-q4_k_m]="--shape qwen3.5-35b-a3b --type q4_k_m --seed 15 --layers 4 --vocab 4096 --fast"
)
NAMES=(qwen35-tiny-q8_0 qwen35moe-tiny-q8_0 qwen35-hd128-q4_k_m qwen35moe-hd128-q4_k_m)
for name in "${NAMES[@]}"; do
    read -r -a args <<<"${MODEL_ARGS[$name]}"
    [[ -s "$MODELS/$name.gguf" ]] || "$SYNTH" "${args[@]}" -o "$MODELS/$name.gguf" >>"$OUT/hybrid-synth.log" 2>&1 ||
        fail "ember-synth $name (see hybrid-synth.log)"
done
BIG_FILE="$MODELS/qwen3.5-35b-a3b-q4_k_m.gguf"
if [[ "${BIG:-0}" != 0 && ! -s "$BIG_FILE" ]]; then
    "$SYNTH" --shape qwen3.5-35b-a3b --type q4_k_m --fast -o "$BIG_FILE" >>"$OUT/hybrid-synth.log" 2>&1 ||
        fail "ember-synth 35B"
fi
if ! wait "$kernels_pid"; then
    fail "kernels or harness build"
    grep -B2 -A10 FAILED "$OUT/hybrid-kernels.log" | head -40
    exit 1
fi
t "kernels and models ready"

t "harness_delta_net"
"$MODELS/harness_delta_net" | tee "$OUT/harness_delta_net.log" | grep -E "^(FAIL|time)|harness_delta_net:" ||
    true
grep -q "every check passed" "$OUT/harness_delta_net.log" || fail "harness_delta_net"

GPU=(--device cuda:0 -ngl 99)
CPU=(--device cpu -t 8)
PROMPTS=("The capital of France is" "Once upon a time, in a small village," "def quicksort(arr):")
dir="$MODELS/runs"
mkdir -p "$dir"
t "greedy runs: CPU vs GPU, and GPU graphs on vs off"
cases="$dir/cases.tsv"
: >"$cases"
for name in "${NAMES[@]}"; do
    m="$MODELS/$name.gguf"
    [[ -s "$m" ]] || continue
    for i in "${!PROMPTS[@]}"; do
        base="$dir/$name.p$i"
        run() { "$EMBER" run -m "$m" -p "${PROMPTS[$i]}" -n "$N_TOKENS" --temp 0 -c 512 --format json "$@"; }
        run "${CPU[@]}" >"$base.cpu.json" 2>"$base.cpu.err" || fail "$name p$i: CPU run ($(tail -1 "$base.cpu.err"))"
        run "${GPU[@]}" >"$base.gpu.json" 2>"$base.gpu.err" || fail "$name p$i: GPU run ($(tail -1 "$base.gpu.err"))"
        EMBER_GPU_GRAPHS=0 run "${GPU[@]}" >"$base.gpu-nographs.json" 2>"$base.gpu-nographs.err" ||
            fail "$name p$i: GPU run without graphs ($(tail -1 "$base.gpu-nographs.err"))"
        printf '%s\t%s\t%s\t%s\n' "$name/p$i" "$base.cpu.json" "$base.gpu.json" "$m" >>"$cases"
        tokens() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens"])' "$1" 2>/dev/null; }
        if [[ "$(tokens "$base.gpu.json")" != "$(tokens "$base.gpu-nographs.json")" || -z "$(tokens "$base.gpu.json")" ]]; then
            fail "$name p$i: GPU tokens with graphs differ from those without"
        fi
    done
done
python3 "$RULE" ember --list "$cases" --reeval-ember "$EMBER" --reeval-device cpu \
    --max-logprob-diff "${MAX_LOGPROB_DIFF:-0.5}" >"$dir/verdicts.txt" 2>&1 || fail "golden_rule ember (CPU vs GPU)"
cat "$dir/verdicts.txt"

t "perplexity: CPU vs GPU"
text="$ROOT/tests/data/golden/gpl-3.txt"
ppl_cases="$dir/ppl.tsv"
: >"$ppl_cases"
for name in "${NAMES[@]}"; do
    m="$MODELS/$name.gguf"
    [[ -s "$m" ]] || continue
    "$EMBER" perplexity -m "$m" -f "$text" -c 512 --chunks "$PPL_CHUNKS" "${CPU[@]}" >"$dir/$name.ppl.cpu.txt" 2>"$dir/$name.ppl.cpu.err" ||
        fail "$name: CPU perplexity"
    "$EMBER" perplexity -m "$m" -f "$text" -c 512 --chunks "$PPL_CHUNKS" "${GPU[@]}" >"$dir/$name.ppl.gpu.txt" 2>"$dir/$name.ppl.gpu.err" ||
        fail "$name: GPU perplexity ($(tail -1 "$dir/$name.ppl.gpu.err"))"
    printf '%s\t%s\t%s\n' "$name/ppl" "$dir/$name.ppl.cpu.txt" "$dir/$name.ppl.gpu.txt" >>"$ppl_cases"
done
python3 "$RULE" ppl --list "$ppl_cases" --tolerance "${PPL_TOLERANCE:-0.01}" >"$dir/ppl-verdicts.txt" 2>&1 ||
    fail "golden_rule ppl (CPU vs GPU)"
cat "$dir/ppl-verdicts.txt"

t "stress: 16 sequences at once on the GPU, memory back to the floor"
m="$MODELS/qwen35moe-hd128-q4_k_m.gguf"
"$EMBER" stress -m "$m" --prompts 17,300,1000 --parallel 16 --waves 2 --gen 32 --memory-report "${GPU[@]}" \
    >"$OUT/hybrid-stress.txt" 2>&1 || fail "ember stress (see hybrid-stress.txt)"
tail -25 "$OUT/hybrid-stress.txt"

t "bench"
bench_models=("$MODELS/qwen35-hd128-q4_k_m.gguf" "$MODELS/qwen35moe-hd128-q4_k_m.gguf")
[[ "${BIG:-0}" != 0 ]] && bench_models+=("$BIG_FILE")
for m in "${bench_models[@]}"; do
    [[ -s "$m" ]] || continue
    "$EMBER" bench -m "$m" -p 512 -n 128 -r 3 "${GPU[@]}" 2>&1 | tail -4 || fail "bench $(basename "$m")"
done

t "done"
if ((${#failures[@]})); then
    echo "hybrid.sh: ${#failures[@]} failure(s):"
    printf '  %s\n' "${failures[@]}"
    exit 1
fi
echo "hybrid.sh: every check passed"
