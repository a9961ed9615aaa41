#!/usr/bin/env bash
# MINEDRAFT on a CPU-only host: the draft server takes the last DRAFT_CORES cores (default 1),
# the target every other core of this shell's affinity (restrict both with taskset).
# usage: launch/minedraft_cpu.sh [TARGET [DRAFT]] [extra sglang / sgl-spec flags...]
#   TARGET: a model directory, hub id or shipped name (default: the shipped sgl-spec/tiny-code)
#   DRAFT: the draft LM; needed with a TARGET of your own (shipped: sgl-spec/tiny-code-draft-narrow)
#   NUM_STEPS: drafts per request per step, a chain (default 3)
# env: HOST (127.0.0.1), PORT (30000), PYTHON (.venv/bin/python); --dry-run or DRY_RUN=1
#      prints the command instead of running it (launch/_common.sh)
set -euo pipefail
# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"
launch_parse 2 "$@"
steps=${NUM_STEPS:-3}
cores=${DRAFT_CORES:-1}
launch_uint NUM_STEPS "$steps"
launch_uint DRAFT_CORES "$cores"
launch_exec --model-path "${POS[0]:-$SHIPPED_TARGET}" --speculative-algorithm MINEDRAFT \
    ${POS[1]:+--speculative-draft-model-path "${POS[1]}"} --speculative-num-steps "$steps" \
    --speculative-draft-device "cpu:$cores"
