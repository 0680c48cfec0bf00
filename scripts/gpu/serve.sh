#!/usr/bin/env bash
# `ember serve` on the H200, side by side with llama.cpp built from source in the same call:
#
#   1. kernels (nvcc, sm_90) and, in the background, llama.cpp (CUDA, 90a) from $LLAMA_SRC (a
#      .tar.gz of the llama.cpp source tree, e.g. the `vendor/llama.cpp` folder of the
#      llama-cpp-python sdist) while ember-synth writes the models;
#   2. throughput: `ember serve` on Llama 3.1 8B Q4_K_M (synthetic, real shape), clients sending
#      a 512-token prompt and generating 128 tokens each, 1/8/32/64 at once (scripts/load.py
#      --sweep), then llama.cpp's `llama-batched-bench` on the same file and workload; a table of
#      total tokens (prompt + generated) per second of wall time and the ratio;
#   3. soak: $SOAK mixed requests (prompts 16..8000 tokens, 10% dropped mid-stream) against
#      `ember serve` on Llama 3.2 1B Q4_0, /metrics before and after, then device memory against
#      the post-load floor after 2 s of idle.
#
# The llama.cpp part runs last so that ember's figures come back even if its build is slow.
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT EMBER=path/to/ember SYNTH=path/to/ember-synth LLAMA_SRC=llama-src.tgz \
#       scripts/gpu/serve.sh     (or LLAMA_BIN=folder instead of LLAMA_SRC)
# Knobs: SOAK (default 2000), SWEEP (default 1,8,32,64), MODELS (default: ember-serve in $TMPDIR),
# ARCH (default sm_90), LLAMA_EXTRA_TARGETS. Prints figures; asserts nothing about speed.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/ember-serve}"
ARCH="${ARCH:-sm_90}"
SOAK="${SOAK:-2000}"
SWEEP="${SWEEP:-1,8,32,64}"
LLAMA_SRC="${LLAMA_SRC:-}"
# More llama.cpp tools to build beside llama-batched-bench (space-separated CMake targets).
LLAMA_EXTRA_TARGETS="${LLAMA_EXTRA_TARGETS:-}"
# Or a folder holding llama-batched-bench and its libraries, built from source in an earlier call.
LLAMA_BIN="${LLAMA_BIN:-}"
# DEVICE=cpu runs everything on the CPU with small models (to test this script itself).
DEVICE="${DEVICE:-cuda:0}"
BIG="${BIG:-llama3-8b}"
SMALL="${SMALL:-llama3.2-1b}"
# Logs go to LOGS and come back as one archive in $OUT (the device tool returns few files).
LOGS="$MODELS/logs"
rm -rf "$LOGS"
mkdir -p "$OUT" "$MODELS" "$LOGS"
trap 'tar czf "$OUT/serve-logs.tgz" -C "$MODELS" logs' EXIT
if [[ "$DEVICE" == cpu ]]; then
    DEVICE_FLAGS=(--device cpu -t "$(nproc)")
else
    DEVICE_FLAGS=(--device "$DEVICE" -ngl 99)
fi
metrics() { python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' "http://127.0.0.1:$1/metrics"; }
export EMBER_KERNELS_DIR="${EMBER_KERNELS_DIR:-$MODELS/kernels}"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }

# 1. Kernels, llama.cpp and models, as much as possible at once.
t "kernels for $ARCH"
[[ "$DEVICE" == cpu ]] && ARCH=none
(if [[ "$ARCH" == none ]]; then exit 0; fi
 # Cubins only (the harnesses are scripts/gpu/h200.sh kernels' business), several at once.
 mkdir -p "$EMBER_KERNELS_DIR/$ARCH"
 ls "$ROOT"/kernels/*.hip | xargs -P "${KERNEL_JOBS:-6}" -I{} sh -c \
     'nvcc -cubin -arch="$1" -O3 -std=c++17 -x cu -I "$2/kernels" -o "$3/$(basename "$4" .hip).cubin" "$4" || echo "FAILED $4"' \
     _ "$ARCH" "$ROOT" "$EMBER_KERNELS_DIR/$ARCH" {} >"$LOGS/kernels.log" 2>&1
 ! grep -q FAILED "$LOGS/kernels.log") &
kernels_pid=$!
llama_pid=
if [[ -n "$LLAMA_SRC" ]]; then
    t "llama.cpp build in the background"
    (mkdir -p "$MODELS/llama" && tar xzf "$LLAMA_SRC" -C "$MODELS/llama" &&
        cd "$MODELS/llama/llama.cpp" &&
        cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release >"$LOGS/llama-build.log" 2>&1 &&
        cmake --build build -j "${LLAMA_JOBS:-10}" --target llama-batched-bench $LLAMA_EXTRA_TARGETS >>"$LOGS/llama-build.log" 2>&1) &
    llama_pid=$!
fi
t "models"
BIG_MODEL="$MODELS/$BIG-q4_k_m.gguf"
SMALL_MODEL="$MODELS/$SMALL-q4_0.gguf"
[[ -s "$BIG_MODEL" ]] || "$SYNTH" --shape "$BIG" --type q4_k_m --fast -o "$BIG_MODEL" >"$LOGS/synth.log" 2>&1
[[ -s "$SMALL_MODEL" ]] || "$SYNTH" --shape "$SMALL" --type q4_0 --fast -o "$SMALL_MODEL" >>"$LOGS/synth.log" 2>&1
wait "$kernels_pid" || { t "kernels failed"; tail -20 "$LOGS/kernels.log"; exit 1; }
[[ "$ARCH" == none ]] || t "kernels ready: $(ls "$EMBER_KERNELS_DIR/$ARCH" | wc -l) cubins"

# Starts `ember serve` on MODEL with extra flags; sets SERVER_PID and PORT.
serve() { # LOG MODEL FLAGS...
    local log="$1" model="$2"
    shift 2
    "$EMBER" serve -m "$model" "${DEVICE_FLAGS[@]}" --port 0 "$@" >"$log" 2>&1 &
    SERVER_PID=$!
    PORT=
    for _ in $(seq 1 600); do
        PORT=$(sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$log" | head -1)
        [[ -n "$PORT" ]] && grep -q "^ready" "$log" && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.2
    done
    t "ember serve did not become ready:"
    tail -20 "$log"
    return 1
}

stop_server() {
    kill -TERM "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID"
    t "ember serve exited with $? after SIGTERM"
}

# 2. Throughput.
t "ember serve on $BIG Q4_K_M: sweep $SWEEP"
if serve "$LOGS/serve-8b.log" "$BIG_MODEL" --parallel 64 --max-queue 256 -c 1024 --kv-tokens 70000 --ubatch 2048; then
    python3 "$ROOT/scripts/load.py" --url "http://127.0.0.1:$PORT" --sweep "$SWEEP" \
        --prompt-tokens 512 --max-tokens 128 --stream --ignore-eos | tee "$LOGS/sweep-ember.txt"
    metrics "$PORT" >"$LOGS/metrics-8b.txt" 2>&1
    stop_server
fi

# 3. Soak and memory.
t "soak: $SOAK mixed requests on $SMALL Q4_0"
if serve "$LOGS/serve-1b.log" "$SMALL_MODEL" --parallel 16 --max-queue 512 -c 8300 --kv-tokens 140000 --ubatch 2048; then
    python3 "$ROOT/scripts/load.py" --url "http://127.0.0.1:$PORT" --soak "$SOAK" --clients 16 \
        --max-tokens 64 --stream | tee "$LOGS/soak.txt"
    if [[ "$DEVICE" != cpu ]]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader | sed 's/^/device memory used after the soak and 2 s idle (nvidia-smi): /'
    fi
    metrics "$PORT" | grep -E "^ember_device_memory|^ember_kv|^ember_prompt|^vllm:" | tee "$LOGS/metrics-soak.txt"
    stop_server
fi
# 4. llama.cpp on the same file and workload, then the side-by-side table.
if [[ -n "$llama_pid" || -n "$LLAMA_BIN" ]]; then
    if [[ -n "$LLAMA_BIN" ]]; then
        bench="$LLAMA_BIN/llama-batched-bench"
        export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    else
        t "waiting for the llama.cpp build"
        bench="$MODELS/llama/llama.cpp/build/bin/llama-batched-bench"
    fi
    if [[ -n "$LLAMA_BIN" ]] || wait "$llama_pid"; then
        t "llama-batched-bench on the same file and workload"
        "$bench" -m "$BIG_MODEL" -ngl 99 -fa on -c 73728 -b 2048 -ub 512 \
            -npp 512 -ntg 128 -npl "$SWEEP" 2>"$LOGS/llama-bench.err" | tee "$LOGS/sweep-llama.txt"
    else
        t "llama.cpp build failed"
        tail -30 "$LOGS/llama-build.log"
    fi
fi
python3 "$ROOT/scripts/gpu/compare_sweep.py" "$LOGS/sweep-ember.txt" "$LOGS/sweep-llama.txt" | tee "$LOGS/sweep-table.md"
t "done"
