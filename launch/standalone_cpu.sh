#!/usr/bin/env bash
# STANDALONE_FULL (SGLang's STANDALONE: a small draft LM drafts a chain; the draft reads the
# whole sequence) on a CPU-only host.
# usage: launch/standalone_cpu.sh [TARGET [DRAFT]] [extra sglang / sgl-spec flags...]
#   TARGET: a model directory, hub id or shipped name (default: the shipped sgl-spec/tiny-code)
#   DRAFT: the draft LM; needed with a TARGET of your own (shipped: sgl-spec/tiny-code-draft-narrow)
#   NUM_STEPS: drafts per step (default 3), verified as a chain of NUM_STEPS + 1 tokens
# env: HOST (127.0.0.1), PORT (30000), PYTHON (.venv/bin/python); --dry-run or DRY_RUN=1
#      prints the command instead of running it (launch/_common.sh)
set -euo pipefail
# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"
launch_parse 2 "$@"
steps=${NUM_STEPS:-3}
launch_uint NUM_STEPS "$steps"
launch_exec --model-path "${POS[0]:-$SHIPPED_TARGET}" --speculative-algorithm STANDALONE_FULL \
    ${POS[1]:+--speculative-draft-model-path "${POS[1]}"} --speculative-num-steps "$steps" \
    --speculative-eagle-topk 1 --speculative-num-draft-tokens "$((steps + 1))"
