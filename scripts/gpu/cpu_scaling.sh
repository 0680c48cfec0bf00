#!/usr/bin/env bash
# ember's CPU backend beside llama.cpp's at 1, 2, 4, 8 and 16 threads on the device machine's own
# CPU (issue 12: "the CPU backend scales with cores"). Builds llama.cpp's CPU backend from a source
# tarball carried with the call (llama.cpp/ inside; -DGGML_CUDA=OFF -DGGML_NATIVE=ON, only
# llama-bench), writes the models with ember-synth, runs `ember bench --device cpu` and
# `llama-bench -ngl 0` (the GPU hidden from both) on the same files at each thread count, and
# prints one table with the ratios ember / llama.cpp for prompt processing and generation.
#
# Usage (on the device machine, from the repository root):
#   OUT=$OUT LLAMA_SRC=llama-src.tgz EMBER=target/release/ember SYNTH=target/release/ember-synth \
#       scripts/gpu/cpu_scaling.sh
# EMBER_BASE=path/to/another/ember adds that binary's figures (a build of main before a change) in
# columns of their own, run beside the others at each thread count.
# LLAMA_BENCH=path/to/llama-bench uses a CPU build made earlier instead of building one.
# Without either, only ember runs (a dry run of everything but llama.cpp; the table's llama.cpp
# columns are then "-"). Knobs (environment), with their defaults:
#   THREADS="1 2 4 8 16"  thread counts (counts above the machine's logical CPUs are skipped)
#   MODELS_LIST="smollm2-135m:q4_0 smollm2-135m:q4_1 llama3.2-1b:q4_k_m"  shape:type to write
#   LAYERS=               N writes every model with N layers (real widths): the MoE shapes
#                         (qwen3-30b-a3b, gemma4-26b-a4b, qwen3.5-35b-a3b) at 10-12 layers fit
#                         the time budget
#   PP=256 TG=64 REPS=2   the tests: the issue asks for pp512/tg128 -r 3, which at one thread on
#                         the 1B model alone takes minutes per engine; these halve the tokens and
#                         drop a repetition so the whole run fits in 8 minutes. Set PP=512 TG=128
#                         REPS=3 (and BUDGET_S=900) when time allows.
#   BUDGET_S=420          seconds of benches after the build; runs that would start later are
#                         skipped and shown as "skipped" (each run is also capped by `timeout`)
#   JOBS=16               build parallelism
#   EMBER_BASE            (see above) doubles the ember time: raise BUDGET_S or drop a model
# Prints figures; asserts nothing about speed. The exit code is non-zero only when a step that
# every figure needs failed (ember-synth, the llama.cpp build).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/cpu-scaling-logs}"
EMBER="${EMBER:-$ROOT/target/release/ember}"
SYNTH="${SYNTH:-$ROOT/target/release/ember-synth}"
EMBER_BASE="${EMBER_BASE:-}"
LLAMA_SRC="${LLAMA_SRC:-}"
LLAMA_BENCH="${LLAMA_BENCH:-}"
THREADS="${THREADS:-1 2 4 8 16}"
MODELS_LIST="${MODELS_LIST:-smollm2-135m:q4_0 smollm2-135m:q4_1 llama3.2-1b:q4_k_m}"
PP="${PP:-256}"
TG="${TG:-64}"
REPS="${REPS:-2}"
BUDGET_S="${BUDGET_S:-420}"
JOBS="${JOBS:-16}"
W="${WORK:-/tmp/ember-cpu-scaling}"
mkdir -p "$OUT" "$W/models"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }
for bin in "$EMBER" "$SYNTH" $EMBER_BASE; do
    [[ -x "$bin" ]] || { echo "not an executable: $bin"; exit 1; }
done
# Neither engine may reach the GPU: the figures are the CPU backends'.
export CUDA_VISIBLE_DEVICES= HIP_VISIBLE_DEVICES=
logical=$(nproc)
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $logical logical CPUs"

# llama.cpp first, alone: a build running beside the benches would take their cores.
llama_bench="$LLAMA_BENCH"
if [[ -z "$llama_bench" && -n "$LLAMA_SRC" ]]; then
    build_llama() { # $1: extra cmake flags
        rm -rf "$W/build"
        (cd "$W" && cmake -S llama.cpp -B build -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
            -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF $1 >/dev/null &&
            cmake --build build -j "$JOBS" --target llama-bench) >"$OUT/llama-build.log" 2>&1
    }
    [[ -d "$W/llama.cpp" ]] || (cd "$W" && tar xzf "$LLAMA_SRC") ||
        { echo "cannot unpack $LLAMA_SRC"; exit 1; }
    build_llama "-DGGML_NATIVE=ON" || { tail -20 "$OUT/llama-build.log"; exit 1; }
    llama_bench="$W/build/bin/llama-bench"
    t "llama.cpp built (GGML_NATIVE=ON)"
fi

models=()
for entry in $MODELS_LIST; do
    m="$W/models/${entry%%:*}-${entry##*:}${LAYERS:+-${LAYERS}l}.gguf"
    fast=$("$SYNTH" --help | grep -q -- '--fast' && echo --fast)
    [[ -s "$m" ]] || "$SYNTH" --shape "${entry%%:*}" --type "${entry##*:}" ${LAYERS:+--layers "$LAYERS"} \
        $fast -o "$m" \
        >"$OUT/synth-$(basename "$m").log" 2>&1 ||
        { t "$entry: ember-synth failed (see $OUT/synth-$(basename "$m").log)"; exit 1; }
    models+=("$m")
done
t "models written"

[[ -n "$llama_bench" ]] && export LD_LIBRARY_PATH="$(dirname "$llama_bench")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ -z "$LLAMA_BENCH" && -n "$llama_bench" ]] &&
    ! "$llama_bench" -m "${models[0]}" -ngl 0 -t 1 -p 8 -n 0 -r 1 >"$OUT/llama-probe.log" 2>&1; then
    # A CPU that advertises AMX while the OS refuses it kills a -march=native build (SIGILL on
    # tilezero, seen on one of these machines): build again for the vector extensions the CPU
    # lists, without AMX.
    tail -5 "$OUT/llama-probe.log"
    flags="-DGGML_NATIVE=OFF"
    for f in avx avx2 fma f16c bmi2 avx512f avx512_vnni avx512_vbmi avx512_bf16 avx_vnni; do
        grep -qw "$f" /proc/cpuinfo && case $f in
            avx512f) flags+=" -DGGML_AVX512=ON" ;;
            *) flags+=" -DGGML_$(echo "$f" | tr a-z A-Z)=ON" ;;
            esac
    done
    build_llama "$flags" || { tail -20 "$OUT/llama-build.log"; exit 1; }
    t "llama.cpp rebuilt without -march=native: $flags"
fi

bench_start=$SECONDS
run() { # $1: output file, then the command; skipped once the budget is spent
    local file=$1 left=$((BUDGET_S - (SECONDS - bench_start)))
    shift
    if ((left < 10)); then
        echo skipped >"$file"
        return
    fi
    timeout "$left" "$@" >"$file" 2>"$file.err" || echo "exit $?" >>"$file"
}
# Thread counts interleaved engine by engine, so a machine that slows down over the run (or the
# budget running out) hits both alike.
for m in "${models[@]}"; do
    name=$(basename "$m" .gguf)
    for th in $THREADS; do
        if ((th > logical)); then
            echo "over the CPU count" >"$OUT/ember-$name-t$th.txt"
            echo "over the CPU count" >"$OUT/llama-$name-t$th.txt"
            echo "over the CPU count" >"$OUT/base-$name-t$th.txt"
            continue
        fi
        run "$OUT/ember-$name-t$th.txt" "$EMBER" bench -m "$m" --device cpu -t "$th" \
            -p "$PP" -n "$TG" -r "$REPS"
        [[ -n "$EMBER_BASE" ]] && run "$OUT/base-$name-t$th.txt" "$EMBER_BASE" bench -m "$m" \
            --device cpu -t "$th" -p "$PP" -n "$TG" -r "$REPS"
        [[ -n "$llama_bench" ]] && run "$OUT/llama-$name-t$th.txt" "$llama_bench" -m "$m" \
            -ngl 0 -t "$th" -p "$PP" -n "$TG" -r "$REPS"
    done
    t "$name done"
done

python3 - "$OUT" "$PP" "$TG" "$THREADS" "${EMBER_BASE:+1}" "${models[@]}" <<'EOF'
import os, re, sys
out, pp, tg, threads = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
with_base = sys.argv[5] == "1"

def figures(path):
    """test name -> t/s from a bench's markdown table (the test is the cell matching pp/tg; the
    last cell is the figure: ember's median, llama-bench's mean), or a note when the run did not
    give one."""
    if not os.path.exists(path):
        return {}, "-"
    found, text = {}, open(path).read()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        test = next((c for c in cells if re.match(r"^(pp|tg)\d+$", c)), None)
        if test:
            found[test] = float(cells[-1].split("±")[0])
    note = "-" if found or not text.strip() else text.strip().splitlines()[-1][:24]
    return found, note

header = ["model", "threads"]
for test in (f"pp{pp}", f"tg{tg}"):
    header += [f"llama.cpp {test}", f"ember {test}", f"{test[:2]} ratio"]
    header += [f"base {test}", f"{test[:2]} ratio, base"] if with_base else []
print("| " + " | ".join(header) + " |")
print("| --- | " + " | ".join("---:" for _ in header[1:]) + " |")
for model in sys.argv[6:]:
    name = os.path.basename(model)[: -len(".gguf")]
    for th in threads:
        ember, ember_note = figures(f"{out}/ember-{name}-t{th}.txt")
        llama, llama_note = figures(f"{out}/llama-{name}-t{th}.txt")
        base, base_note = figures(f"{out}/base-{name}-t{th}.txt")
        cells = []
        for test in (f"pp{pp}", f"tg{tg}"):
            e, l, b = ember.get(test), llama.get(test), base.get(test)
            cells += [f"{l:.2f}" if l else llama_note, f"{e:.2f}" if e else ember_note,
                      f"{e / l:.2f}x" if e and l else "-"]
            if with_base:
                cells += [f"{b:.2f}" if b else base_note, f"{b / l:.2f}x" if b and l else "-"]
        print(f"| {name} | {th} | " + " | ".join(cells) + " |")
EOF
t "done"
