#!/usr/bin/env bash
# GPU check on one CUDA device at world size 1 (NCCL), all parts in one go (benchmarks/gpu_check.py):
# 1 ZeRO 0-3 x 32-true/bf16-mixed/16-mixed x token-exact loss correctness matrix, 2 meta init at ZeRO-3,
# 3 FlashCheckpoint kill + resume, 4 NodeHealthCheck, 6 gradient compression (PowerSGD, bf16 reductions,
# int8 gathers), 7 models we did not write (Hugging Face Llama + PEFT LoRA, ResNet with BatchNorm, a
# Fabric loop) against Lightning's own single-device runs, and last 5 throughput (ours bf16-mixed ZeRO-2
# vs Lightning's own bf16-mixed, GPT ~300M, fused AdamW).
# Budget on one H200: parts 1-4, 6, 7 < 3 min, part 5 < 4 min; measured there (2026-12-04): 46 s and 68 s.
# Results (JSON) and the log land in ${OUT:-/tmp/gpu_check}; exit status 1 if any check failed.
# Usage: bash benchmarks/gpu_check.sh [--steps 20] [--parts 1,2,3,4] [--device cpu --quick]
# The GPU machine has `python3` (the one holding torch) and perhaps no `python`: PYTHON overrides.
set -euo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m benchmarks.gpu_check --out-dir "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
