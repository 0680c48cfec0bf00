#!/usr/bin/env bash
# Issue 11's H200 checks for the mixture-of-experts and hybrid models at their real shapes, in one
# device call: llama.cpp built from a carried source tarball (the `vendor/llama.cpp` folder of the
# llama-cpp-python sdist, packed as llama.cpp/...), ember's kernels, and for each model written
# by ember-synth (random weights, real shape, Q4_K_M):
#   1. accuracy: `llama-perplexity --kl-divergence-base` on the GPU saves llama.cpp's
#      distributions over $CHUNKS x $CTX tokens of text; `ember perplexity --kl-divergence` on the
#      GPU compares against them (mean KLD, its 99th percentile, top-1 agreement);
#   2. speed: `ember bench` and `llama-bench -fa 1`, pp512 and tg128, with ratios and the fraction
#      of the bandwidth limit that decode reaches counting the weight bytes a token reads (the
#      routed experts in use, one embedding row, every other tensor whole: `ember info`'s
#      "weights read per decoded token");
#   3. memory: `ember stress --parallel 16 --memory-report` (memory back to the floor after a
#      burst of 16 concurrent sequences; for the hybrids the recurrent state included).
# Models are written and deleted one at a time (each is 16-21 GB; the machine has 64 GB of disk).
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT LLAMA_SRC=llama-src.tgz EMBER=path/to/ember SYNTH=path/to/ember-synth \
#       scripts/gpu/models_side_by_side.sh
# CALIBRATE=1 adds the yardsticks: ember's GPU run against ember's CPU run, and llama.cpp's CPU
# run against llama.cpp's GPU run, on the same tokens. Random weights amplify rounding: on an
# H100 (2026-12-07) llama.cpp's own CPU and GPU runs differed by mean KLD 2.4 on Qwen3-30B-A3B
# and 0.13 even at 4 layers, so the cross-engine figure means little without them.
# LAYERS=N writes each model with N layers (real widths), for that shallower comparison.
# Knobs: MODELS_LIST ("shape:type ..."), CTX and CHUNKS (the KLD text: CTX x CHUNKS tokens, of
# which llama-perplexity scores the second half of each chunk), REPS, BANDWIDTH_GBS (default the
# H200's 4800), STRESS=0 to skip the stress runs, LLAMA_BUILD (a folder with an existing build),
# BEFORE_LLAMA (a command run once, before the first llama.cpp step, to use the build's wait).
# Prints figures and the KLD verdicts (mean KLD <= 1e-3 is issue 11's bound); exits non-zero when a
# step failed to run, not on a figure.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:?EMBER: the ember binary}"
SYNTH="${SYNTH:?SYNTH: the ember-synth binary}"
MODELS_LIST="${MODELS_LIST:-qwen3-30b-a3b:q4_k_m gemma4-26b-a4b:q4_k_m qwen3.5-35b-a3b:q4_k_m}"
CTX="${CTX:-512}"
CHUNKS="${CHUNKS:-8}"
REPS="${REPS:-3}"
BANDWIDTH_GBS="${BANDWIDTH_GBS:-4800}"
TEXT="${TEXT:-$ROOT/tests/data/golden/gpl-3.txt}"
W="${WORK:-/tmp/ember-models-sbs}"
mkdir -p "$OUT" "$W/models" "$W/kernels/sm_90"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }
failed=0

LLAMA_BUILD="${LLAMA_BUILD:-}"
if [[ -z "$LLAMA_BUILD" ]]; then
    LLAMA_SRC="${LLAMA_SRC:?LLAMA_SRC: a tarball holding llama.cpp/}"
    LLAMA_BUILD="$W/build"
    (cd "$W" && tar xzf "$LLAMA_SRC" &&
        cmake -S llama.cpp -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DLLAMA_CURL=OFF \
            -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF >/dev/null &&
        cmake --build build -j "${LLAMA_JOBS:-13}" --target llama-bench llama-perplexity) \
        >"$OUT/llama-build.log" 2>&1 &
    llama_build=$!
fi

ls "$ROOT"/kernels/*.hip | xargs -P 3 -I{} sh -c \
    'nvcc -cubin -arch=sm_90 -O3 -std=c++17 -x cu -I "$1/kernels" -o "$2/$(basename "$3" .hip).cubin" "$3" || echo "FAILED $3"' \
    _ "$ROOT" "$W/kernels/sm_90" {} >"$OUT/kernels.log" 2>&1
if grep -q FAILED "$OUT/kernels.log"; then
    grep -A10 FAILED "$OUT/kernels.log" | head -40
    exit 1
fi
export EMBER_KERNELS_DIR="$W/kernels"
t "kernels compiled"

GPU=(--device cuda:0 -ngl 99)
llama_ready() {
    if [[ -n "${BEFORE_LLAMA:-}" ]]; then
        # Other GPU work for the same call, run while llama.cpp still builds (once).
        t "BEFORE_LLAMA: $BEFORE_LLAMA"
        bash -c "$BEFORE_LLAMA"
        BEFORE_LLAMA=""
    fi
    if [[ -n "${llama_build:-}" ]]; then
        wait "$llama_build" || { tail -20 "$OUT/llama-build.log"; exit 1; }
        llama_build=""
        t "llama.cpp built"
    fi
    export LD_LIBRARY_PATH="$LLAMA_BUILD/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# A model's name in file names and tables: shape-type, and -Nl with LAYERS=N.
name_of() { echo "${1%%:*}-${1##*:}${LAYERS:+-${LAYERS}l}"; }
NAMES=$(for entry in $MODELS_LIST; do name_of "$entry"; done)

for entry in $MODELS_LIST; do
    name=$(name_of "$entry")
    m="$W/models/$name.gguf"
    "$SYNTH" --shape "${entry%%:*}" --type "${entry##*:}" ${LAYERS:+--layers "$LAYERS"} --fast -o "$m" \
        >"$OUT/synth-$name.log" 2>&1 ||
        { t "$name: ember-synth failed"; tail -3 "$OUT/synth-$name.log"; failed=1; continue; }
    t "$name written ($(du -h "$m" | cut -f1))"
    "$EMBER" info -m "$m" >"$OUT/info-$name.txt" 2>&1

    # ember first (its kernels are ready while llama.cpp may still be building).
    "$EMBER" bench -m "$m" "${GPU[@]}" -p 512 -n 128 -r "$REPS" >"$OUT/ember-bench-$name.txt" \
        2>"$OUT/ember-bench-$name.err" || { t "$name: ember bench failed"; tail -5 "$OUT/ember-bench-$name.err"; failed=1; }
    if [[ "${STRESS:-1}" != 0 ]]; then
        "$EMBER" stress -m "$m" "${GPU[@]}" --prompts 17,300,1000 --parallel 16 --waves 2 --gen 32 \
            --memory-report >"$OUT/stress-$name.txt" 2>&1 || { t "$name: stress failed"; failed=1; }
        t "$name: ember bench and stress done"
    fi

    if [[ "${CALIBRATE:-0}" != 0 ]]; then
        # ember's own CPU run as the base of its GPU run: the fast path against exact CPU numerics.
        "$EMBER" perplexity -m "$m" --device cpu -t "${CPU_THREADS:-16}" -f "$TEXT" -c "$CTX" \
            --chunks "$CHUNKS" --kl-divergence-base "$W/ember-cpu.kld" >"$OUT/ember-cpu-ppl-$name.txt" 2>&1 &&
            "$EMBER" perplexity -m "$m" "${GPU[@]}" --kl-divergence-base "$W/ember-cpu.kld" --kl-divergence \
                >"$OUT/kld-ember-gpu-vs-cpu-$name.txt" 2>&1 || { t "$name: ember CPU/GPU KLD failed"; failed=1; }
        rm -f "$W/ember-cpu.kld"
        t "$name: ember GPU against ember CPU done"
    fi

    llama_ready
    "$LLAMA_BUILD/bin/llama-perplexity" -m "$m" -f "$TEXT" -c "$CTX" --chunks "$CHUNKS" -ngl 99 -fa on \
        --kl-divergence-base "$W/base.kld" >"$OUT/llama-ppl-$name.txt" 2>&1 ||
        { t "$name: llama-perplexity failed"; tail -5 "$OUT/llama-ppl-$name.txt"; failed=1; }
    if [[ -s "$W/base.kld" ]]; then
        "$EMBER" perplexity -m "$m" "${GPU[@]}" --kl-divergence-base "$W/base.kld" --kl-divergence \
            >"$OUT/kld-$name.txt" 2>&1 || { t "$name: ember KLD failed"; tail -5 "$OUT/kld-$name.txt"; failed=1; }
    fi
    if [[ "${CALIBRATE:-0}" != 0 && -s "$W/base.kld" ]]; then
        # llama.cpp's own CPU run against its GPU base: how far two correct implementations of
        # this model drift apart, the yardstick for the figures above.
        CUDA_VISIBLE_DEVICES= "$LLAMA_BUILD/bin/llama-perplexity" -m "$m" -t "${CPU_THREADS:-16}" -ngl 0 \
            --kl-divergence-base "$W/base.kld" --kl-divergence >"$OUT/kld-llama-cpu-vs-gpu-$name.txt" 2>&1 ||
            { t "$name: llama.cpp CPU KLD failed"; tail -5 "$OUT/kld-llama-cpu-vs-gpu-$name.txt"; failed=1; }
        t "$name: llama.cpp CPU against llama.cpp GPU done"
    fi
    rm -f "$W/base.kld"
    "$LLAMA_BUILD/bin/llama-bench" -m "$m" -ngl 99 -fa 1 -p 512 -n 128 -r "$REPS" \
        >"$OUT/llama-bench-$name.txt" 2>&1 || { t "$name: llama-bench failed"; failed=1; }
    t "$name: llama.cpp done"
    rm -f "$m"
done

python3 - "$OUT" "$BANDWIDTH_GBS" $NAMES <<'EOF'
import os, re, sys
out, bandwidth = sys.argv[1], float(sys.argv[2]) * 1e9

def read(name):
    try:
        return open(os.path.join(out, name), errors="replace").read()
    except OSError:
        return ""

def llama(text, test):
    # llama-bench's markdown rows: | model | size | params | backend | ngl | fa | test | t/s |
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[-2] == test:
            return float(cells[-1].split("±")[0])
    return None

def ember(text, test):
    # ember bench's rows: | model | size | params | backend | threads | test | t/s | median t/s |
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[-3] == test:
            return float(cells[-1])
    return None

def active_bytes(text):
    # `ember info`: "weights read per decoded token: N MiB (...)"
    m = re.search(r"weights read per decoded token:\s*([0-9.]+)\s*(GB|GiB|MB|MiB)", text)
    if not m:
        return None
    scale = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20}[m.group(2)]
    return float(m.group(1)) * scale

print("\n| model | test | llama.cpp t/s | ember t/s | ember / llama.cpp | ember bandwidth share |")
print("| --- | --- | ---: | ---: | ---: | ---: |")
for name in sys.argv[3:]:
    eb, lb = read(f"ember-bench-{name}.txt"), read(f"llama-bench-{name}.txt")
    act = active_bytes(read(f"info-{name}.txt"))
    for test in ("pp512", "tg128"):
        e, l = ember(eb, test), llama(lb, test)
        ratio = f"{e / l:.2f}" if e and l else "-"
        share = f"{e * act / bandwidth:.0%}" if (e and act and test == "tg128") else ""
        print(f"| {name} | {test} | {l or '-'} | {e or '-'} | {ratio} | {share} |")
print("\nKLD, ember GPU (fast numerics) against llama.cpp GPU on the same tokens:")
for name in sys.argv[3:]:
    for label, file in (
        ("ember GPU against llama.cpp GPU", f"kld-{name}.txt"),
        ("ember GPU against ember CPU", f"kld-ember-gpu-vs-cpu-{name}.txt"),
        ("llama.cpp CPU against llama.cpp GPU", f"kld-llama-cpu-vs-gpu-{name}.txt"),
    ):
        kld = read(file)
        if not kld:
            continue
        lines = [l for l in kld.splitlines() if re.search(r"^KLD|same top|Mean\s+KLD|Same top|99\.0%|Maximum KLD", l.strip())]
        print(f"-- {name}, {label}:")
        for l in lines[:8]:
            print("   " + l.strip())
EOF
for name in $NAMES; do
    echo "-- memory, $name:"
    grep -iE "floor|idle|peak|recurrent|state|wave" "$OUT/stress-$name.txt" 2>/dev/null | tail -12
done
t "done"
exit $failed
