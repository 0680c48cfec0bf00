#!/usr/bin/env bash
# MoE decode on the GPU (H200), in one call: the fused decode kernels (route, gate/up with the
# activation, down with the weighted sum; Gemma 4's router input in one launch) checked and
# timed, without llama.cpp.
#
#   1. kernels (nvcc, every kernels/*.hip into $EMBER_KERNELS_DIR/$ARCH) and the two harnesses
#      that check the new kernels bit for bit against the ops they replace (harness_moe: the
#      decode kernels against the tile path, with per-kernel decode timings; harness: the fused
#      router-input norm), while ember-synth writes Qwen3-30B-A3B and Gemma 4 26B-A4B at their
#      real shapes in Q4_K_M (--fast) and a 4-layer Qwen3.5-35B-A3B (shared expert with a gate);
#   2. the same greedy tokens and log-probabilities with the decode kernels and with the tile
#      path they replace (EMBER_MOE_DECODE_MAX_TOKENS=0), as the kernels are bit-exact, 64 tokens
#      per model with decode graphs on;
#   3. `ember bench -p 512 -n 128` per model, tile path then decode kernels, on the same binary.
# With EMBER_BASE (another ember binary, e.g. main's before this work, run on the same kernels,
# which keep every kernel it calls with the same values), its greedy output must equal this
# binary's too (every fusion here is bit-exact), and it is benched first.
#
# Usage (on the GPU machine, from the repository root; about 8 minutes with models to write):
#   OUT=$OUT [EMBER=target/release/ember] [SYNTH=target/release/ember-synth] [MODELS=dir]
#   [REPS=2] [SKIP_BENCH=1] [EMBER_BASE=path/to/main/ember] scripts/gpu/moe_decode.sh
# Prints `PASS`/`FAIL` lines and the figures; exits non-zero when a check failed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-moe}"
ARCH="${ARCH:-sm_90}"
REPS="${REPS:-2}"
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
mkdir -p "$OUT" "$MODELS" "$EMBER_KERNELS_DIR/$ARCH"
start=$SECONDS
failures=0
t() { echo "[t=$((SECONDS - start))s] $*"; }
verdict() { # $1: 0 for pass, $2: what
    if [[ $1 == 0 ]]; then echo "PASS $2"; else echo "FAIL $2"; failures=$((failures + 1)); fi
}

t "kernels and harnesses for $ARCH, models"
(ls "$ROOT"/kernels/*.hip | xargs -P 8 -I{} sh -c \
     'nvcc -cubin -arch="$1" -O3 -std=c++17 -x cu -I "$2/kernels" -o "$3/$(basename "$4" .hip).cubin" "$4" || echo "FAILED $4"' \
     _ "$ARCH" "$ROOT" "$EMBER_KERNELS_DIR/$ARCH" {} >"$OUT/kernels.log" 2>&1
 ! grep -q FAILED "$OUT/kernels.log") &
kernels_pid=$!
harness_pids=()
for h in harness_moe harness; do
    nvcc -std=c++17 -O2 -arch="$ARCH" -x cu -I "$ROOT/kernels" "$ROOT/kernels/tests/$h.cu" -o "$MODELS/$h" >"$OUT/$h-build.log" 2>&1 &
    harness_pids+=($!)
done
QWEN="$MODELS/qwen3-30b-a3b-q4_k_m.gguf"
GEMMA="$MODELS/gemma4-26b-a4b-q4_k_m.gguf"
HYBRID="$MODELS/qwen35moe-4l-q4_k_m.gguf"
([[ -s "$QWEN" ]] || "$SYNTH" --shape qwen3-30b-a3b --type q4_k_m --fast -o "$QWEN"
 [[ -s "$GEMMA" ]] || "$SYNTH" --shape gemma4-26b-a4b --type q4_k_m --fast -o "$GEMMA"
 [[ -s "$HYBRID" ]] || "$SYNTH" --shape qwen3.5-35b-a3b --type q4_k_m --seed 15 --layers 4 --vocab 4096 --fast -o "$HYBRID"
) >"$OUT/synth.log" 2>&1 &
synth_pid=$!
wait "$kernels_pid"
verdict $? "every kernels/*.hip compiles with nvcc for $ARCH"
wait "${harness_pids[@]}"

t "harnesses (the models are being written meanwhile)"
for h in harness_moe harness; do
    if [[ ! -x "$MODELS/$h" ]]; then
        verdict 1 "$h builds"; tail -20 "$OUT/$h-build.log"; continue
    fi
    "$MODELS/$h" >"$OUT/$h.log" 2>&1
    status=$?
    grep -E "FAIL|moe_swiglu|moe_geglu|moe_down|INFO moe decode|rms_norm_scale_mul|rms_norm_add" "$OUT/$h.log"
    verdict "$status" "$h (every check; log in $OUT/$h.log)"
done

wait "$synth_pid"
GPU=(--device cuda:0 -ngl 99)
for m in "$QWEN" "$GEMMA" "$HYBRID"; do
    name="$(basename "$m" .gguf)"
    [[ -s "$m" ]] || { verdict 1 "$name written (see $OUT/synth.log)"; continue; }
    t "$name: greedy, tile path vs decode kernels"
    for path in tiles decode; do
        limit=$([[ $path == tiles ]] && echo 0 || echo 4)
        EMBER_MOE_DECODE_MAX_TOKENS=$limit "$EMBER" run -m "$m" "${GPU[@]}" -p "The experts of this layer" -n 64 --temp 0 \
            --format json >"$OUT/run-$name-$path.json" 2>"$OUT/run-$name-$path.err"
    done
    if [[ -s "$OUT/run-$name-decode.json" ]] && cmp -s "$OUT/run-$name-tiles.json" "$OUT/run-$name-decode.json"; then
        verdict 0 "$name: identical greedy tokens and log-probabilities, decode kernels vs tile path (64 tokens)"
    else
        verdict 1 "$name: decode kernels vs tile path differ"
        tail -3 "$OUT/run-$name-decode.err"
        python3 - "$OUT/run-$name-tiles.json" "$OUT/run-$name-decode.json" <<'EOF' || true
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ta, tb = a.get("tokens", []), b.get("tokens", [])
first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
print(f"  tokens: {len(ta)} vs {len(tb)}, first difference at {first}")
EOF
    fi
    if [[ -n "${EMBER_BASE:-}" ]]; then
        "$EMBER_BASE" run -m "$m" "${GPU[@]}" -p "The experts of this layer" -n 64 --temp 0 --format json \
            >"$OUT/run-$name-base.json" 2>"$OUT/run-$name-base.err"
        [[ -s "$OUT/run-$name-base.json" ]] && cmp -s "$OUT/run-$name-base.json" "$OUT/run-$name-decode.json"
        verdict $? "$name: identical greedy tokens and log-probabilities, this binary vs EMBER_BASE"
    fi
    if [[ -z "${SKIP_BENCH:-}" ]]; then
        if [[ -n "${EMBER_BASE:-}" ]]; then
            echo "EMBER_BASE"
            "$EMBER_BASE" bench -m "$m" "${GPU[@]}" -p 512 -n 128 -r "$REPS" 2>"$OUT/bench-$name-base.err" | tail -3
        fi
        t "$name: ember bench, tile path then decode kernels"
        for limit in 0 4; do
            echo "EMBER_MOE_DECODE_MAX_TOKENS=$limit"
            EMBER_MOE_DECODE_MAX_TOKENS=$limit "$EMBER" bench -m "$m" "${GPU[@]}" -p 512 -n 128 -r "$REPS" 2>"$OUT/bench-$name-$limit.err" | tail -3
        done
    fi
done
t "done: $failures failure(s)"
[[ $failures == 0 ]]
