#!/usr/bin/env bash
# The benchmark's runs on one TPU v5e chip, in parts of under ten minutes each, so that each
# fits one command on a machine lent for a short while. Run from a copy of the repository holding
# .whl-tpu/ and .whl-tunix/ (benchmarks/tpu/tpu_wheels.sh and benchmarks/accelerator/tunix_wheels.sh, run where
# there is network); each part writes its reports under OUT (default /tmp/v5e) and the first
# installs what the others reuse, on the same machine.
#
#   bash benchmarks/tpu/v5e_session.sh peers     # jaxtune beside Tunix, Gemma 3 1B LoRA at 8 x 512, jaxtune's step profiled
#   bash benchmarks/tpu/v5e_session.sh llama     # jaxtune beside Tunix, Llama 3.2 1B LoRA at 8 x 512, profiled
#   bash benchmarks/tpu/v5e_session.sh decode    # greedy decoding at 8, 32 and 64 prompts (each batch's first call
#                                                # compiles for about 45 s on the chip)
#   bash benchmarks/tpu/v5e_session.sh grpo      # a GRPO step at 8 prompts x 8 answers x 256 tokens (its first step
#                                                # compiles three train-step candidates, the sampler and the update)
#   bash benchmarks/tpu/v5e_session.sh scan      # the Gemma LoRA step with model.scan_layers
#   bash benchmarks/tpu/v5e_session.sh stacked   # the Gemma LoRA step cold, unrolled then with its layers stacked and
#                                                # scanned, each from an empty cache, then the stacked one again with
#                                                # another learning rate, seed and step count
#   bash benchmarks/tpu/v5e_session.sh scanned   # layers stacked, each from an empty cache: the Gemma LoRA step cold, then
#                                                # again with another learning rate and seed; Gemma 3 4B LoRA at 8 x 1024 (the recipe's r=8
#                                                # on the attention projections, as the unrolled run of the issue)
#   bash benchmarks/tpu/v5e_session.sh scanned-12b  # layers stacked: Gemma 3 12B LoRA over an nf4 base at 4 x 1024
#   bash benchmarks/tpu/v5e_session.sh scanned-more # layers stacked: Gemma 3 1B full fine-tune at 4 x 4096, the GRPO step
#   bash benchmarks/tpu/v5e_session.sh llama8b   # Llama 3.1 8B's shape over an nf4 base, LoRA 4 x 1024, layers stacked
#   bash benchmarks/tpu/v5e_session.sh rerun     # the Gemma LoRA step's first step cold (no cache), then again with another
#                                                # learning rate and seed: the kept plan and executable, no trace or compile
#   bash benchmarks/tpu/v5e_session.sh gemma4b   # Gemma 3 4B LoRA, bf16 base, at 8 x 1024 and 1 x 16384, with defaults
#   bash benchmarks/tpu/v5e_session.sh long      # Gemma 3 1B LoRA at 1 x 32768, with defaults
#   bash benchmarks/tpu/v5e_session.sh gemma12b  # Gemma 3 12B LoRA over an nf4 base (quantized as it loads) at 4 x 1024
#                                                # (these three: LoRA r=16 on every linear layer, as WIDE sets; WIDE= for the
#                                                # recipe's r=8 on the attention projections; MINUTES=... for longer)
#   bash benchmarks/tpu/v5e_session.sh real      # the Gemma 3 270M recipe (configs/gemma3-270m-offline-lora.yaml): a real
#                                                # checkpoint trained on the chip, every stage, without Prefect. Its GGUF
#                                                # file (238 MiB) travels in pieces: here, `python -m jaxtune.offline.checkpoints`
#                                                # then `split -b 48M .jaxtune/models/gemma-3-270m-q4_k_m.gguf .carry/gemma-270m.`;
#                                                # each piece carried by a call of its own on one warm machine
#   bash benchmarks/tpu/v5e_session.sh stages    # tpu_check.py: every stage of the offline pipeline on the chip (as
#                                                # `make tpu-check`), called without Prefect: the machine has no socket
#
# A part's files come back from a lent machine only a few at a time, so the profile's traces travel as one archive.
# A lent machine's copy has no .git: set JAXTUNE_COMMIT to the commit it copies (git rev-parse --short=12 HEAD, here)
# so that every result records it (benchmarks/common/harness.provenance).
set -euo pipefail
part=${1:?which part: peers, llama, decode, grpo, scan, stacked, scanned, scanned-12b, scanned-more, llama8b, rerun, gemma4b, long, gemma12b, real or stages}
out=${OUT:-/tmp/v5e}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=/dev/null
source benchmarks/tpu/tpu_install.sh
export PYTHONUNBUFFERED=1 JAXTUNE_COMPILE_CACHE=/tmp/xla-cache
[ -d .git ] || [ -n "${JAXTUNE_COMMIT:-}" ] || echo "v5e_session.sh: JAXTUNE_COMMIT unset: the results will not name their commit" >&2
WIDE=${WIDE-"--set lora.r=16 --set lora.alpha=32 --set lora.target_modules=all-linear"}
if [ "$part" = peers ] || [ "$part" = llama ]; then  # only these run Tunix's side
    [ -f /tmp/tunix-site/.done ] || { benchmarks/accelerator/tunix_wheels.sh install /tmp/tunix-site && touch /tmp/tunix-site/.done; }
    export TUNIX_SITE=/tmp/tunix-site
fi

case "$part" in
peers)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --parts tunix --section lora --cases 8x512 --profile \
        --minutes 7.8 --out "$out/peers-gemma3"
    tar czf "$out/peers-profile.tgz" -C "$out" peers-gemma3-profile && rm -rf "$out/peers-gemma3-profile" ;;
llama)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --parts tunix --section lora --cases 8x512 --profile \
        --model llama-3.2-1b --minutes 4.5 --out "$out/peers-llama3"
    tar czf "$out/llama-profile.tgz" -C "$out" peers-llama3-profile && rm -rf "$out/peers-llama3-profile" ;;
decode)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section decode --minutes 6 --out "$out/decode" ;;
grpo)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section grpo --cases 8x8x256 --minutes 8.8 --out "$out/grpo" ;;
scan)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 8x512 --set model.scan_layers=true \
        --minutes 4 --out "$out/scan" ;;
stacked)
    for scan in false true; do
        rm -rf "$JAXTUNE_COMPILE_CACHE"
        python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 8x512 --minutes "${MINUTES:-3}" \
            --set model.scan_layers=$scan --out "$out/stacked-$scan"
    done
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 8x512 --minutes 2 \
        --set model.scan_layers=true --set train.learning_rate=5e-5 --set train.seed=7 --out "$out/stacked-rerun" ;;
scanned)
    rm -rf "$JAXTUNE_COMPILE_CACHE"
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 8x512 --minutes 2 \
        --set model.scan_layers=true --out "$out/scanned-gemma3-1b"
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 8x512 --minutes 1.2 \
        --set model.scan_layers=true --set train.learning_rate=5e-5 --set train.seed=7 --out "$out/scanned-gemma3-1b-rerun"
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --model gemma-3-4b --cases 8x1024 \
        --set model.scan_layers=true --minutes "${MINUTES:-3.5}" --out "$out/scanned-gemma3-4b" ;;
scanned-12b)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --model gemma-3-12b --cases 4x1024 \
        --set model.base_quantization=nf4 $WIDE --set model.scan_layers=true --minutes "${MINUTES:-4}" \
        --out "$out/scanned-gemma3-12b-nf4" ;;
scanned-more)
    rm -rf "$JAXTUNE_COMPILE_CACHE"
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section full --cases 4x4096 --set model.scan_layers=true \
        --minutes 2.5 --out "$out/scanned-gemma3-1b-full"
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section grpo --cases 8x8x256 --set model.scan_layers=true \
        --minutes "${MINUTES:-4.5}" --out "$out/scanned-grpo" ;;
llama8b)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --model llama-3.1-8b --cases 4x1024 \
        --set model.base_quantization=nf4 --set model.scan_layers=true --minutes "${MINUTES:-9}" --out "$out/llama8b-nf4" ;;
rerun)
    rm -rf "$JAXTUNE_COMPILE_CACHE"
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 8x512 --minutes 4 --out "$out/rerun-cold"
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 8x512 --minutes 3 \
        --set train.learning_rate=5e-5 --set train.seed=7 --out "$out/rerun-warm" ;;
gemma4b)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --model gemma-3-4b --cases 8x1024 \
        --cases 1x16384 $WIDE --minutes "${MINUTES:-8.5}" --out "$out/gemma3-4b" ;;
long)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 1x32768 $WIDE --minutes "${MINUTES:-6}" \
        --out "$out/gemma3-1b-32k" ;;
gemma12b)
    python3 -m benchmarks.accelerator.bench --parts jaxtune --section lora --model gemma-3-12b --cases 4x1024 \
        --set model.base_quantization=nf4 $WIDE --minutes "${MINUTES:-9}" --out "$out/gemma3-12b-nf4" ;;
real)
    gguf=.jaxtune/models/gemma-3-270m-q4_k_m.gguf
    if [ ! -f "$gguf" ]; then
        mkdir -p .jaxtune/models
        cat .carry/gemma-270m.* > "$gguf"
    fi
    sha256sum "$gguf"
    PYTHONHASHSEED=0 python3 -m benchmarks.tpu.tpu_check --no-prefect --parts pipeline \
        --recipe configs/gemma3-270m-offline-lora.yaml --out "$out/real" ;;
stages)
    PYTHONHASHSEED=0 python3 -m benchmarks.tpu.tpu_check --no-prefect --out "$out/tpu-check" ;;
*)
    echo "v5e_session.sh: no part $part (peers, llama, decode, grpo, scan, rerun, gemma4b, long, gemma12b, real or stages)" >&2
    exit 2 ;;
esac
ls -la "$out"
