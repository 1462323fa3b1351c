#!/usr/bin/env bash
# GPU check (one CUDA device, world size 1, NCCL): lightning_par bf16-mixed (ZeRO-2, fp32 masters in the
# shard) against Lightning's own single-device bf16-mixed, on a GPT of ~300M parameters. Each run is its
# own process so peak memory is per implementation. Results land in ${OUT:-/tmp}.
# Usage: bash benchmarks/gpu_check.sh [extra args for both runs, e.g. --steps 20]
set -euo pipefail
out="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1
python -m benchmarks.gpu_check --impl lightning --out "$out/gpu_lightning.json" "$@"
python -m benchmarks.gpu_check --impl ours --out "$out/gpu_ours.json" "$@"
python -m benchmarks.gpu_check --compare "$out/gpu_ours.json" "$out/gpu_lightning.json" | tee "$out/gpu_compare.json"
