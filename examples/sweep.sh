#!/usr/bin/env bash
# A Hydra sweep over multi-process jobs: every job trains with its own 2 processes and output folder;
# the sweep folder collects each job's final metrics in summary.csv / summary.json.
#   bash examples/sweep.sh                      # 2 strategies x 2 precisions, smoke-sized
#   bash examples/sweep.sh hydra.sweep.dir=/tmp/my_sweep
set -euo pipefail
exec lightning-par-train -m experiment=smoke strategy=zero1,zero2 precision=32-true,bf16-mixed "$@"
