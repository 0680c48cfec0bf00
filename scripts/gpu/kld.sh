#!/usr/bin/env bash
# Accuracy of the GPU's fast numerics, measured as llama.cpp's perplexity tool measures it (issue
# 12): for a synthetic model of every weight type, `ember perplexity --kl-divergence-base` on the
# CPU saves the reference distributions over $CHUNKS x $CTX tokens of text, then the GPU run
# (fast numerics, decode graphs and fused kernels on) is compared with `--kl-divergence`: mean
# KLD, its 99th percentile and the share of positions whose top token is the same. Prints one
# table and the verdict against the issue's bounds (mean KLD <= 0.001, top-1 >= 99%).
#
# Usage (on the GPU machine, from the repository root; kernels already compiled into
# $EMBER_KERNELS_DIR, e.g. by scripts/gpu/side_by_side.sh or models_side_by_side.sh):
#   OUT=$OUT EMBER=path/to/ember SYNTH=path/to/ember-synth EMBER_KERNELS_DIR=dir scripts/gpu/kld.sh
# LLAMA_BIN (a folder with llama-perplexity and its libraries, CUDA build) adds the yardstick:
# llama.cpp's own GPU run against the same CPU base (ember's CPU agrees with llama.cpp's CPU to a
# KLD of about 1e-6 on these files), so each row shows how far llama.cpp's GPU path drifts too.
# Knobs: DEVICE (default cuda:0; cpu tests the script itself), TYPES, SHAPE (default qwen3-0.6b), LAYERS (default 4), CTX, CHUNKS, THREADS (CPU side).
# Exit status: non-zero when a run failed or a type is outside the bounds.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/target/h200-logs}"
EMBER="${EMBER:?EMBER: the ember binary}"
SYNTH="${SYNTH:?SYNTH: the ember-synth binary}"
TYPES="${TYPES:-f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k q4_k_m}"
SHAPE="${SHAPE:-qwen3-0.6b}"
LAYERS="${LAYERS:-4}"
CTX="${CTX:-512}"
CHUNKS="${CHUNKS:-4}"
THREADS="${THREADS:-8}"
TEXT="${TEXT:-$ROOT/tests/data/golden/gpl-3.txt}"
W="${WORK:-/tmp/ember-kld}"
mkdir -p "$OUT" "$W"
status=0
GPU=(--device "${DEVICE:-cuda:0}" -ngl 99)
[[ "${DEVICE:-cuda:0}" == cpu ]] && GPU=(--device cpu -t "$THREADS")

printf '\n| type | mean KLD | KLD 99%% | same top token | verdict | llama.cpp GPU: mean KLD | llama.cpp GPU: same top |\n| --- | ---: | ---: | ---: | --- | ---: | ---: |\n' >"$OUT/kld-table.md"
for ty in $TYPES; do
    m="$W/$SHAPE-$ty.gguf"
    pure=(--pure)
    [[ $ty == q4_k_m ]] && pure=()
    "$SYNTH" --shape "$SHAPE" --type "$ty" "${pure[@]}" --layers "$LAYERS" -o "$m" >/dev/null 2>&1 ||
        { echo "$ty: ember-synth failed"; status=1; continue; }
    "$EMBER" perplexity -m "$m" --device cpu -t "$THREADS" -f "$TEXT" -c "$CTX" --chunks "$CHUNKS" \
        --kl-divergence-base "$W/base-$ty.kld" >"$OUT/kld-cpu-$ty.log" 2>&1 ||
        { echo "$ty: CPU base run failed"; tail -3 "$OUT/kld-cpu-$ty.log"; status=1; continue; }
    "$EMBER" perplexity -m "$m" "${GPU[@]}" --kl-divergence-base "$W/base-$ty.kld" --kl-divergence >"$OUT/kld-gpu-$ty.log" 2>&1 ||
        { echo "$ty: GPU run failed"; tail -3 "$OUT/kld-gpu-$ty.log"; status=1; continue; }
    if [[ -n "${LLAMA_BIN:-}" ]]; then
        LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$LLAMA_BIN/llama-perplexity" \
            -m "$m" -ngl 99 --kl-divergence-base "$W/base-$ty.kld" --kl-divergence >"$OUT/kld-llama-gpu-$ty.log" 2>&1 ||
            echo "$ty: llama.cpp GPU run failed"
    fi
    rm -f "$W/base-$ty.kld" "$m"
    # "KLD: mean M +/- E, median ..., 99% P, max X (N positions)" and "same top token: T %"
    python3 - "$ty" "$OUT/kld-gpu-$ty.log" >>"$OUT/kld-table.md" <<'EOF' || status=1
import os, re, sys
ty, text = sys.argv[1], open(sys.argv[2]).read()
lpath = sys.argv[2].replace("kld-gpu-", "kld-llama-gpu-")
ltext = open(lpath).read() if os.path.exists(lpath) else ""
lk = re.search(r"Mean\s+KLD:\s*(-?[0-9.]+)", ltext)
lt = re.search(r"Same top p:\s*([0-9.]+)", ltext)
llama = f" {float(lk.group(1)):.6f} | {float(lt.group(1)):.2f} % |" if (lk and lt) else " - | - |"
k = re.search(r"KLD: mean (-?[0-9.]+).*?99% (-?[0-9.]+)", text)
top = re.search(r"same top token: ([0-9.]+) %", text)
if not (k and top):
    print(f"| {ty} | ? | ? | ? | unparsed |{llama}")
    sys.exit(1)
mean, p99, same = float(k.group(1)), float(k.group(2)), float(top.group(1))
ok = mean <= 0.001 and same >= 99.0
print(f"| {ty} | {mean:.6f} | {p99:.6f} | {same:.2f} % | {'ok' if ok else 'OUT OF BOUNDS'} |{llama}")
sys.exit(0 if ok else 1)
EOF
done
echo "KLD of the GPU's fast numerics against the CPU: $SHAPE, $LAYERS layers, $CHUNKS x $CTX tokens"
cat "$OUT/kld-table.md"
exit $status
