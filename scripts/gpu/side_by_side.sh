#!/usr/bin/env bash
# ember beside llama.cpp on the H200 in one device call (issue 12's side-by-side command): builds
# llama.cpp from a source tarball carried with the call (the `vendor/llama.cpp` folder of the
# llama-cpp-python sdist, packed as llama.cpp/...), compiles ember's kernels, writes the synthetic
# models with ember-synth, runs `ember bench` and `llama-bench` on the same files, and prints one
# table with the ratios and the fraction of the bandwidth limit each decode reaches. Then the
# per-kernel profile of a decode step for both (scripts/gpu/profile.sh).
#
# Usage (on the GPU machine, from the repository root):
#   OUT=$OUT LLAMA_SRC=llama-src.tgz EMBER=path/to/ember SYNTH=path/to/ember-synth \
#       scripts/gpu/side_by_side.sh
# Knobs: MODELS_LIST ("shape:type ..."), DEPTHS (comma-separated, as llama-bench's -d), REPS,
# BANDWIDTH_GBS (the limit the fractions are taken against, default the H200's 4800 GB/s),
# PROFILE=0 to skip the profiles. Prints figures; asserts nothing about speed.
#
# Before and after in the same call: EMBER_BASE (another ember binary) with BASE_KERNELS (the
# kernels/ folder it was built with, e.g. `git archive BASE kernels | tar x -C base`) is benched
# too, base and new alternating per repetition (REPS runs of `-r 3` each, so a drifting clock
# hits both), and its greedy output on a fixed prompt is compared with the new build's (the same
# bytes, or DIFFER: expected only where a change alters rounding). The table then has the base's
# t/s and new / base.
# Ran as `.h200/run1.sh` on 2026-12-03 (its figures are in that session's closing note).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:?EMBER: the ember binary}"
SYNTH="${SYNTH:?SYNTH: the ember-synth binary}"
LLAMA_SRC="${LLAMA_SRC:?LLAMA_SRC: a tarball holding llama.cpp/}"
MODELS_LIST="${MODELS_LIST:-llama3.2-1b:q4_0 llama3-8b:q4_0 llama3-8b:q4_k_m}"
DEPTHS="${DEPTHS:-0,4096}"
REPS="${REPS:-3}"
BANDWIDTH_GBS="${BANDWIDTH_GBS:-4800}"
W="${WORK:-/tmp/ember-side-by-side}"
mkdir -p "$OUT" "$W/models" "$W/kernels/sm_90"
start=$SECONDS
t() { echo "[t=$((SECONDS - start))s] $*"; }

# llama.cpp builds in the background while the kernels and models are made.
(cd "$W" && tar xzf "$LLAMA_SRC" &&
    cmake -S llama.cpp -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DLLAMA_CURL=OFF \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF >/dev/null &&
    cmake --build build -j 12 --target llama-bench) >"$OUT/llama-build.log" 2>&1 &
llama_build=$!

ls "$ROOT"/kernels/*.hip | xargs -P 4 -I{} sh -c \
    'nvcc -cubin -arch=sm_90 -O3 -std=c++17 -x cu -I "$1/kernels" -o "$2/$(basename "$3" .hip).cubin" "$3" || echo "FAILED $3"' \
    _ "$ROOT" "$W/kernels/sm_90" {} >"$OUT/kernels.log" 2>&1
if [[ -n "${EMBER_BASE:-}" ]]; then
    BASE_KERNELS="${BASE_KERNELS:?BASE_KERNELS: the kernels/ folder EMBER_BASE was built with}"
    mkdir -p "$W/base-kernels/sm_90"
    ls "$BASE_KERNELS"/*.hip | xargs -P 4 -I{} sh -c \
        'nvcc -cubin -arch=sm_90 -O3 -std=c++17 -x cu -I "$1" -o "$2/$(basename "$3" .hip).cubin" "$3" || echo "FAILED $3"' \
        _ "$BASE_KERNELS" "$W/base-kernels/sm_90" {} >>"$OUT/kernels.log" 2>&1
fi
if grep -q FAILED "$OUT/kernels.log"; then
    grep -A10 FAILED "$OUT/kernels.log" | head -40
    exit 1
fi
export EMBER_KERNELS_DIR="$W/kernels"
t "kernels compiled"

models=()
for entry in $MODELS_LIST; do
    m="$W/models/${entry%%:*}-${entry##*:}.gguf"
    [[ -s "$m" ]] || "$SYNTH" --shape "${entry%%:*}" --type "${entry##*:}" --fast -o "$m" >/dev/null 2>&1 ||
        { t "$entry: ember-synth failed"; continue; }
    models+=("$m")
done
t "models written"

for m in "${models[@]}"; do
    name="$(basename "$m")"
    if [[ -n "${EMBER_BASE:-}" ]]; then
        # Alternating runs of three repetitions; the table takes the median of each build's runs.
        : >"$OUT/ember-$name.txt"
        : >"$OUT/base-$name.txt"
        for ((i = 0; i < REPS; i++)); do
            EMBER_KERNELS_DIR="$W/base-kernels" "$EMBER_BASE" bench -m "$m" --device cuda:0 -ngl 99 -p 512 -n 128 \
                -d "$DEPTHS" -r 3 2>>"$OUT/base-$name.err" | grep -E "pp512|tg128" >>"$OUT/base-$name.txt"
            "$EMBER" bench -m "$m" --device cuda:0 -ngl 99 -p 512 -n 128 -d "$DEPTHS" -r 3 \
                2>>"$OUT/ember-$name.err" | grep -E "pp512|tg128" >>"$OUT/ember-$name.txt"
        done
        EMBER_KERNELS_DIR="$W/base-kernels" "$EMBER_BASE" run -m "$m" --device cuda:0 -ngl 99 -p "The history of the" \
            -n 48 --temp 0 >"$OUT/greedy-base-$name.txt" 2>/dev/null
        "$EMBER" run -m "$m" --device cuda:0 -ngl 99 -p "The history of the" -n 48 --temp 0 \
            >"$OUT/greedy-new-$name.txt" 2>/dev/null
        if cmp -s "$OUT/greedy-base-$name.txt" "$OUT/greedy-new-$name.txt"; then
            t "$name: greedy output the same as the base's ($(wc -c <"$OUT/greedy-new-$name.txt") bytes)"
        else
            t "$name: greedy output DIFFERS from the base's"
        fi
    else
        "$EMBER" bench -m "$m" --device cuda:0 -ngl 99 -p 512 -n 128 -d "$DEPTHS" -r "$REPS" \
            2>"$OUT/ember-$name.err" | grep -E "pp512|tg128" >"$OUT/ember-$name.txt"
    fi
done
t "ember benches done"
if [[ "${PROFILE:-1}" != 0 && ${#models[@]} -gt 0 ]]; then
    OUT="$OUT" EMBER="$EMBER" MODEL="${models[-1]}" STEPS=8 timeout 150 bash "$ROOT/scripts/gpu/profile.sh"
fi

wait "$llama_build" || { tail -20 "$OUT/llama-build.log"; exit 1; }
t "llama.cpp built"
export LD_LIBRARY_PATH="$W/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for m in "${models[@]}"; do
    "$W/build/bin/llama-bench" -m "$m" -ngl 99 -fa 1 -p 512 -n 128 -d "$DEPTHS" -r "$REPS" 2>&1 |
        grep -E "pp512|tg128" >"$OUT/llama-$(basename "$m").txt"
done
t "llama.cpp benches done"

python3 - "$OUT" "$BANDWIDTH_GBS" "${models[@]}" <<'EOF'
import os, re, statistics, sys
out, bandwidth = sys.argv[1], float(sys.argv[2]) * 1e9

def rows(path, value_column):
    """test name -> t/s from a markdown table printed by a bench (the test is the column before
    the figures; value_column counts from the end); a test printed by several runs (base and
    new alternating) gets the median of its runs."""
    found = {}
    if not os.path.exists(path):
        return found
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        test = next((c for c in cells if re.match(r"^(pp|tg)\d+( @ d\d+)?$", c)), None)
        if test:
            found.setdefault(test, []).append(float(cells[value_column].split("±")[0]))
    return {test: statistics.median(values) for test, values in found.items()}

with_base = any(os.path.exists(f"{out}/base-{os.path.basename(m)}.txt") for m in sys.argv[3:])
base_head = " base t/s | new / base |" if with_base else ""
print(f"| model | test | llama.cpp t/s |{base_head} ember t/s | ember / llama.cpp | ember, share of {bandwidth / 1e9:.0f} GB/s |")
print("| --- | --- | ---: |" + (" ---: | ---: |" if with_base else "") + " ---: | ---: | ---: |")
for model in sys.argv[3:]:
    name = os.path.basename(model)
    size = os.path.getsize(model)
    ember = rows(f"{out}/ember-{name}.txt", -1)  # the median
    llama = rows(f"{out}/llama-{name}.txt", -1)  # the mean
    base = rows(f"{out}/base-{name}.txt", -1)
    for test in ember:
        e, l, b = ember[test], llama.get(test), base.get(test)
        ratio = f"{e / l:.2f}" if l else "-"
        base_cells = (f" {b if b else '-'} | {e / b:.3f} |" if b else " - | - |") if with_base else ""
        # A decoded token reads every weight once; the file size (which counts the whole
        # embedding table, of which a token reads one row) slightly overstates the bytes.
        share = f"{e * size / bandwidth:.0%}" if test.startswith("tg") else ""
        print(f"| {name} | {test} | {l if l else '-'} |{base_cells} {e} | {ratio} | {share} |")
EOF
t "done"
