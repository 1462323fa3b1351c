#!/usr/bin/env bash
# What a session lent a GPU runs there, in one call of the device tool (see benchmarks/README.md):
#   1. the GPU check's correctness parts (1-4, 6, 7: benchmarks/gpu_check.sh) into $OUT/c;
#   2. the main job (README's first command, `trainer=gpu`), at its default strategy and at ZeRO-3 in
#      bf16-mixed, 600 steps each: the last progress lines and metrics.json into $OUT/main_jobs.log;
#   3. the throughput part (5) into $OUT/t.
# Each step has its own time limit, so a later one cut short leaves the earlier results intact.
# Carried Python wheels in .whl/ (hydra-core, omegaconf, antlr4: the main job needs them, the GPU
# machine lacks them) are installed first.
# Options: --cpu (the same steps on this CPU with tiny sizes), --parts LIST (check parts, default
# 1,2,3,4,6,7), --jobs 'OVERRIDES;OVERRIDES' (the main jobs' extra overrides, ';'-separated, default
# ';strategy=zero3 precision=bf16-mixed'), --no-throughput. Exit status: 0 when every step succeeded.
set -uo pipefail
out="${OUT:-/tmp/gpu_run}"
py="${PYTHON:-python3}"
check=() trainer="trainer=gpu" steps=600 limits=(240 75 180)
parts="1,2,3,4,6,7" jobs=";strategy=zero3 precision=bf16-mixed" throughput=1
while [ $# -gt 0 ]; do
    case "$1" in
    --cpu) check=(--device cpu --quick) trainer="trainer=cpu trainer.val_check_interval=10" steps=20 ;;
    --parts) parts="$2" && shift ;;
    --jobs) jobs="$2" && shift ;;
    --no-throughput) throughput=0 ;;
    *) echo "unknown option $1" >&2 && exit 2 ;;
    esac
    shift
done
mkdir -p "$out/c" "$out/t"
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
nvidia-smi -L 2>/dev/null || true
if [ -n "$parts" ]; then
    OUT="$out/c" timeout "${limits[0]}" bash benchmarks/gpu_check.sh --parts "$parts" "${check[@]}" || status=1
fi
work=$(mktemp -d)
IFS=';' read -r -a extras <<<"$jobs"
[ "${jobs: -1}" = ";" ] && extras+=("")  # a trailing ';' names the default job too
for extra in "${extras[@]}"; do
    start=$(date +%s)
    # shellcheck disable=SC2086  # the words of $trainer and $extra are separate overrides
    timeout "${limits[1]}" "$py" -m lightning_par.train $trainer trainer.max_steps=$steps $extra \
        hydra.run.dir="$work/run" >"$work/log" 2>&1 || status=1
    {
        echo "== lightning-par-train $trainer trainer.max_steps=$steps $extra: $(($(date +%s) - start)) s"
        tr '\r' '\n' <"$work/log" | grep -v '^\s*$' | grep -v 'Validation' | tail -n 4
        cat "$work/run/metrics.json" 2>/dev/null || echo "(no metrics.json)"
        echo
    } >>"$out/main_jobs.log"
    rm -rf "$work/run"
done
rm -rf "$work"
if [ "$throughput" = 1 ]; then
    OUT="$out/t" timeout "${limits[2]}" bash benchmarks/gpu_check.sh --parts 5 "${check[@]}" || status=1
fi
exit $status
