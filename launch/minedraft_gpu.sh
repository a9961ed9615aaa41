#!/usr/bin/env bash
# MINEDRAFT on N+1 GPUs: the target on GPUs GPU..GPU+N-1 (--tp-size N), the draft server, a
# process of its own, on GPU GPU+N. Defaults (N=1, GPU=0): target on cuda:0, draft on cuda:1.
# usage: launch/minedraft_gpu.sh [TARGET [DRAFT]] [extra sglang / sgl-spec flags...]
#   TARGET: a model directory, hub id or shipped name (default: the shipped sgl-spec/tiny-code)
#   DRAFT: the draft LM; needed with a TARGET of your own (shipped: sgl-spec/tiny-code-draft-narrow)
#   TP: N, the target's tensor-parallel size (default 1)
#   GPU: the target's first GPU (default 0); DRAFT_DEVICE: the draft server's (cuda:GPU+N)
#   NUM_STEPS: drafts per request per step, a chain (default 3)
# env: HOST (127.0.0.1), PORT (30000), PYTHON (.venv/bin/python); --dry-run or DRY_RUN=1
#      prints the command instead of running it (launch/_common.sh)
set -euo pipefail
# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"
launch_parse 2 "$@"
steps=${NUM_STEPS:-3}
tp=${TP:-1}
gpu=${GPU:-0}
launch_uint NUM_STEPS "$steps"
launch_uint TP "$tp"
launch_uint GPU "$gpu"
launch_exec --model-path "${POS[0]:-$SHIPPED_TARGET}" --speculative-algorithm MINEDRAFT \
    ${POS[1]:+--speculative-draft-model-path "${POS[1]}"} --speculative-num-steps "$steps" \
    --device cuda --tp-size "$tp" --base-gpu-id "$gpu" \
    --speculative-draft-device "${DRAFT_DEVICE:-cuda:$((gpu + tp))}"
