#!/usr/bin/env bash
# Where a decode step's GPU time goes, ember beside llama.cpp, from Nsight Compute's per-kernel
# durations (`ncu --metrics gpu__time_duration.sum`, clocks left alone). Graphs are turned off in
# both engines so each kernel is seen on its own; the figures are device time only (no launch or
# recording cost).
#
#   ember:     `ember run -p X -n $STEPS` (one short prompt pass, then decode steps)
#   llama.cpp: `llama-bench -p 0 -n $STEPS -r 1` (a one-token warm-up, then one measured run)
#
# Prints, per engine, each kernel's launches, total and mean time, and the total divided by the
# passes run, sorted by total. Usage (on the GPU machine, from the repository root):
#   EMBER=path/to/ember LLAMA_BIN=folder MODEL=file.gguf [STEPS=8] [ONLY=llama] scripts/gpu/profile.sh
#
# SECTIONS=REGEX adds, for ember, Nsight Compute's full sections (`--set full`) of the kernels
# whose names match REGEX, over COUNT launches (default 16) after the first SKIP (default 30:
# past the prompt pass and into the decode steps), summarised by kernel_stats.py as one row per
# launch: time, registers, grid, waves, achieved occupancy, IPC, cycles per issued instruction,
# warps per scheduler, DRAM share, instructions. This is what tells a kernel bound by its
# instructions or too few warps from one bound by memory. The report is kept as
# $OUT/ncu-sections.ncu-rep (open it with `ncu -i`).
set -uo pipefail

EMBER="${EMBER:?EMBER: the ember binary}"
MODEL="${MODEL:?MODEL: a GGUF file}"
STEPS="${STEPS:-8}"
LLAMA_BIN="${LLAMA_BIN:-}"
OUT="${OUT:-/tmp}"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
[[ -x "$NCU" ]] || { echo "ncu not found"; exit 1; }

summarise() { # $1: csv, $2: passes
    python3 - "$1" "$2" <<'EOF'
import csv, sys, collections
path, passes = sys.argv[1], int(sys.argv[2])
scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
total = collections.defaultdict(float)
count = collections.Counter()
with open(path, newline="") as f:
    rows = [r for r in csv.reader(f)]
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
cols = rows[head]
k, u, v = cols.index("Kernel Name"), cols.index("Metric Unit"), cols.index("Metric Value")
for r in rows[head + 1:]:
    if len(r) <= v or not r[v]:
        continue
    name = r[k].split("(")[0].split("<")[0].strip()
    us = float(r[v].replace(",", "")) * scale.get(r[u], 1.0)
    total[name] += us
    count[name] += 1
all_us = sum(total.values())
n = sum(count.values())
print(f"  {n} kernel launches, {all_us:.0f} us in all, {all_us / passes:.1f} us and {n / passes:.1f} launches per pass ({passes} passes)")
for name, us in sorted(total.items(), key=lambda x: -x[1])[:25]:
    print(f"  {us / passes:9.1f} us/pass {count[name] / passes:6.1f} launches/pass {us / count[name]:8.2f} us each  {name}")
EOF
}

if [[ "${ONLY:-}" != llama ]]; then
echo "== ember: $(basename "$MODEL"), 1 prompt pass + $((STEPS - 1)) decode steps, graphs off"
EMBER_GPU_GRAPHS=0 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
    "$EMBER" run -m "$MODEL" --device cuda:0 -ngl 99 -p "Hello" -n "$STEPS" --temp 0 \
    >"$OUT/ncu-ember.csv" 2>"$OUT/ncu-ember.err" || tail -5 "$OUT/ncu-ember.err"
summarise "$OUT/ncu-ember.csv" "$STEPS"
fi

if [[ -n "${SECTIONS:-}" && "${ONLY:-}" != llama ]]; then
    echo "== ember: full sections of the kernels matching '$SECTIONS' (launches ${SKIP:-30}+1 to ${SKIP:-30}+${COUNT:-16}), graphs off"
    EMBER_GPU_GRAPHS=0 "$NCU" --clock-control none --set full -k "regex:$SECTIONS" \
        --launch-skip "${SKIP:-30}" --launch-count "${COUNT:-16}" -f -o "$OUT/ncu-sections" \
        "$EMBER" run -m "$MODEL" --device cuda:0 -ngl 99 -p "Hello" -n "$STEPS" --temp 0 \
        >"$OUT/ncu-sections.out" 2>&1 || tail -5 "$OUT/ncu-sections.out"
    "$NCU" -i "$OUT/ncu-sections.ncu-rep" --page details >"$OUT/ncu-sections.txt" 2>&1 &&
        python3 "$(dirname "$0")/kernel_stats.py" "$OUT/ncu-sections.txt"
fi

if [[ -n "$LLAMA_BIN" ]]; then
    echo "== llama.cpp: $(basename "$MODEL"), llama-bench -n $STEPS (a one-token warm-up, then $STEPS tokens), graphs off"
    LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" GGML_CUDA_DISABLE_GRAPHS=1 \
        "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
        "$LLAMA_BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 0 -n "$STEPS" -r 1 \
        >"$OUT/ncu-llama.csv" 2>"$OUT/ncu-llama.err" || tail -5 "$OUT/ncu-llama.err"
    summarise "$OUT/ncu-llama.csv" "$((STEPS + 1))"
fi
