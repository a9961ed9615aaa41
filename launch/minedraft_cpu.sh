#!/usr/bin/env bash
# MINEDRAFT on a CPU-only host: the draft server takes the last DRAFT_CORES cores (default 1),
# the target every other core of this shell's affinity (restrict both with taskset).
# usage: launch/minedraft_cpu.sh [TARGET [DRAFT]] [extra sglang / sgl-spec flags...]
# Defaults: the shipped target and draft model (sgl-spec/tiny-code, sgl-spec/tiny-code-draft).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=sgl-spec/tiny-code; DRAFT=sgl-spec/tiny-code-draft
if [[ $# -gt 0 && $1 != --* ]]; then TARGET=$1; shift; fi
if [[ $# -gt 0 && $1 != --* ]]; then DRAFT=$1; shift; fi
exec .venv/bin/python -m sgl_spec.launch_server --model-path "$TARGET" \
    --speculative-algorithm MINEDRAFT --speculative-draft-model-path "$DRAFT" \
    --speculative-draft-device "cpu:${DRAFT_CORES:-1}" \
    --speculative-num-steps "${NUM_STEPS:-3}" \
    --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}" "$@"
