#!/usr/bin/env python3
"""Regenerates the reference logits under tests/data/reference/ from llama.cpp.

For each reference model: writes the tiny synthetic model with ember-synth (the command is
recorded in the JSON, and engine/tests/reference_logits.rs writes the same file from the same
fields), evaluates a fixed token sequence with llama.cpp's CPU backend in one batch, and stores
per position the log-sum-exp of the full logit row and the 20 largest logits. The llama.cpp is
the one scripts/reference/build_llama.sh builds (llama-cpp-python 0.3.36's vendored snapshot).

The machine must have AVX-512 (the script refuses otherwise): ember's CPU kernels sum in the order
of llama.cpp's AVX-512 build, and an AVX2-only build rounds differently enough to choose other
experts now and then (on qwen3moe-tiny its logits differ from the AVX-512 ones by up to 0.4).

Usage: scripts/reference/reference_logits.py [NAME ...]   (default: every reference model)
Standard library only; needs cargo, cmake and a C compiler.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "target" / "reference"
OUT_DIR = REPO / "tests" / "data" / "reference"

TOP_K = 20
THREADS = 2

# llama.cpp as vendored in the sdist that build_llama.sh fetches and checks.
LLAMA_CPP = {
    "source": "PyPI sdist llama-cpp-python==0.3.36, vendor/llama.cpp",
    "sdist_sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "commit": "ggml-org/llama.cpp@0c1e57098 (llama-cpp-python 0.3.36 CHANGELOG)",
    "backend": "CPU, GGML_NATIVE=OFF with the AVX2/AVX-512 flags of the build machine, AMX off",
}

# The tiny models. `overrides` are ember-synth's shape flags (ShapeOverrides, flag names with
# dashes turned into underscores), written in ShapeOverrides::to_args order.
MODELS = {
    "qwen3moe-tiny": {
        "shape": "qwen3-30b-a3b",
        "type": "q8_0",
        "seed": 11,
        "pure": False,
        "overrides": {
            "layers": 3,
            "vocab": 1024,
            "embd": 128,
            "heads": 8,
            "kv_heads": 1,
            "head_dim": 64,
            "expert_ff": 32,
        },
        "why": (
            "Qwen3-30B-A3B's structure (128 experts, 8 used, normalised softmax routing, QK-norm, "
            "NeoX rope, untied embeddings) at a width of 128 and 32-row experts, 3 layers, 1024 "
            "tokens: 5.7 MiB. Q8_0 weights: GGML's x86 CPU backend multiplies Q8_0 (expert "
            "stacks included) with plain vec_dot or llamafile's tinyBLAS, which sum in the same "
            "order as ember's Q8_0 kernels, and never repacks them on x86; K-quant expert "
            "stacks would go through GGML's separate tiled mul_mat_id path."
        ),
    },
    "qwen35-tiny": {
        "shape": "qwen3.5-27b",
        "type": "q8_0",
        "seed": 12,
        "pure": False,
        "overrides": {
            "layers": 4,
            "vocab": 1024,
            "embd": 128,
            "heads": 4,
            "kv_heads": 1,
            "head_dim": 64,
            "ff": 256,
            "linear_k_heads": 2,
            "linear_v_heads": 4,
            "linear_head_dim": 32,
        },
        "why": (
            "Qwen3.5-27B's structure at a width of 128, 4 layers: three Gated DeltaNet layers (2 "
            "key heads and 4 value heads of 32, so value heads share key heads; a 4-tap causal "
            "convolution; gated RMS norm) and one gated full-attention layer (query gate, QK-norm, "
            "interleaved multi-section rope on 16 of 64 dims, sections [11, 11, 10, 0]), dense "
            "FFN, untied embeddings, 1024 tokens. Q8_0 weights as for qwen3moe-tiny. llama.cpp's "
            "CPU backend runs the fused ggml_gated_delta_net op for the prompt (the sequential "
            "recurrence; its chunked graph form is only used where the fused op is missing)."
        ),
    },
    "qwen35moe-tiny": {
        "shape": "qwen3.5-35b-a3b",
        "type": "q8_0",
        "seed": 13,
        "pure": False,
        "overrides": {
            "layers": 4,
            "vocab": 1024,
            "embd": 128,
            "heads": 4,
            "kv_heads": 1,
            "head_dim": 64,
            "experts": 16,
            "experts_used": 4,
            "expert_ff": 32,
            "shared_ff": 64,
            "linear_k_heads": 2,
            "linear_v_heads": 4,
            "linear_head_dim": 32,
        },
        "why": (
            "Qwen3.5-35B-A3B's structure at a width of 128, 4 layers (three Gated DeltaNet, one "
            "gated full attention, as qwen35-tiny) with a mixture of 16 experts of 32 rows, 4 used "
            "per token (normalised softmax routing), plus a shared expert of 64 rows scaled by "
            "sigmoid(ffn_gate_inp_shexp x) in every layer, 1024 tokens. Q8_0 weights."
        ),
    },
    "gemma4-tiny": {
        "shape": "gemma4-26b-a4b",
        "type": "q8_0",
        "seed": 11,
        "pure": False,
        "overrides": {
            "layers": 6,
            "vocab": 1024,
            "embd": 128,
            "heads": 4,
            "kv_heads": 2,
            "head_dim": 32,
            "ff": 64,
            "expert_ff": 32,
            "window": 16,
            "global_head_dim": 64,
            "global_kv_heads": 1,
        },
        "why": (
            "Gemma 4 26B-A4B's structure at a width of 128: five sliding layers (head 32, 2 KV "
            "heads, window 16 so the 64 tokens are masked) and one global layer (head 64, 1 KV "
            "head, no attn_v: K serves as V, proportional rope through rope_freqs), 128 experts "
            "of 32 rows (8 used) beside a dense GeGLU FFN of 64 rows in every layer with the "
            "router input scale and per-expert output scales, value norm, layer output scales, "
            "logit soft-cap. Q8_0 weights, for the reasons given for qwen3moe-tiny."
        ),
    },
    "gemma4-e2b-tiny": {
        "shape": "gemma4-e2b",
        "type": "q8_0",
        "seed": 12,
        "pure": False,
        "overrides": {
            "layers": 10,
            "vocab": 1024,
            "embd": 128,
            "heads": 4,
            "kv_heads": 1,
            "head_dim": 32,
            "ff": 64,
            "window": 16,
            "global_head_dim": 64,
            "global_kv_heads": 1,
            "shared_kv_layers": 5,
            "per_layer_embd": 32,
        },
        "why": (
            "Gemma 4 E2B's structure at a width of 128: layers in groups of four sliding (head "
            "32, window 16) and one global (head 64); the last 5 of 10 layers keep no cache and "
            "attend over layers 3 (sliding) and 4 (global), with FFNs twice as wide; per-layer "
            "token embeddings of 32 per layer. Q8_0 weights, for the reasons given for "
            "qwen3moe-tiny."
        ),
    },
}

N_TOKENS = 64
TOKEN_SEED = 20261202
OVERRIDE_ORDER = [
    "layers", "vocab", "embd", "heads", "kv_heads", "head_dim", "ff",
    "experts", "experts_used", "expert_ff", "shared_ff",
    "linear_k_heads", "linear_v_heads", "linear_head_dim",
    "window", "global_head_dim", "global_kv_heads", "shared_kv_layers", "per_layer_embd",
]


def splitmix64(state):
    """One step of SplitMix64: (new state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return state, z ^ (z >> 31)


def token_sequence(n_vocab):
    """N_TOKENS ids, each the next SplitMix64 output (seed TOKEN_SEED) modulo the vocabulary."""
    state, ids = TOKEN_SEED, []
    for _ in range(N_TOKENS):
        state, out = splitmix64(state)
        ids.append(out % n_vocab)
    return ids


def synth_args(spec, output):
    args = ["--shape", spec["shape"], "--type", spec["type"], "--seed", str(spec["seed"])]
    if spec["pure"]:
        args.append("--pure")
    for key in OVERRIDE_ORDER:
        if key in spec["overrides"]:
            args += ["--" + key.replace("_", "-"), str(spec["overrides"][key])]
    return args + ["-o", output]


def run(cmd, **kwargs):
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr)
    return subprocess.run(cmd, check=True, **kwargs)


def main(names):
    for name in names:
        if name not in MODELS:
            sys.exit(f"unknown reference model {name!r}: expected one of {', '.join(MODELS)}")
    dump_logits = run([str(REPO / "scripts/reference/build_llama.sh")], capture_output=True,
                      text=True).stdout.strip().splitlines()[-1]
    run(["cargo", "build", "--release", "-p", "ember-synth"], cwd=REPO)
    synth = REPO / "target" / "release" / "ember-synth"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in names:
        spec = MODELS[name]
        model = WORK / f"{name}.gguf"
        args = synth_args(spec, f"{name}.gguf")
        run([str(synth)] + args[:-1] + [str(model)], cwd=REPO)
        n_vocab = spec["overrides"]["vocab"]
        tokens = token_sequence(n_vocab)
        dumped = json.loads(run([dump_logits, str(model), str(THREADS), str(TOP_K),
                                 ",".join(map(str, tokens))],
                                capture_output=True, text=True).stdout)
        if "AVX512 = 1" not in dumped["system_info"]:
            sys.exit(f"{name}: llama.cpp was built without AVX-512 ({dumped['system_info'].strip()}); "
                     "regenerate the references on a machine with AVX-512")
        if dumped["n_vocab"] != n_vocab:
            sys.exit(f"{name}: llama.cpp reports {dumped['n_vocab']} tokens, expected {n_vocab}")
        reference = {
            "about": (
                "Reference logits from llama.cpp for engine/tests/reference_logits.rs; "
                "regenerate with scripts/reference/reference_logits.py " + name
            ),
            "llama_cpp": dict(LLAMA_CPP, system_info=dumped["system_info"].strip(),
                              threads=THREADS),
            "synth": {
                "command": "ember-synth " + " ".join(args),
                "shape": spec["shape"],
                "type": spec["type"],
                "seed": spec["seed"],
                "pure": spec["pure"],
                "overrides": spec["overrides"],
                "why": spec["why"],
            },
            "evaluation": (
                f"the {N_TOKENS} tokens as one batch of one sequence at positions 0..{N_TOKENS - 1}, "
                "logits of every position"
            ),
            "tokens_generator": (
                f"SplitMix64 seeded with {TOKEN_SEED}, each output modulo the vocabulary size"
            ),
            "tokens": tokens,
            "top_k": TOP_K,
            "n_vocab": n_vocab,
            "positions": dumped["positions"],
        }
        out = OUT_DIR / f"{name}.json"
        # One key, and one position, per line keeps the file small and its diffs readable.
        lines = ["{"]
        lines += [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in reference.items()
                  if k != "positions"]
        lines.append(' "positions": [')
        lines += ["  " + json.dumps(p) + ("," if i + 1 < len(dumped["positions"]) else "")
                  for i, p in enumerate(dumped["positions"])]
        lines.append(" ]")
        lines.append("}")
        out.write_text("\n".join(lines) + "\n")
        json.loads(out.read_text())
        print(f"wrote {out.relative_to(REPO)}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
