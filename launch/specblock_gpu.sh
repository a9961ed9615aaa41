#!/usr/bin/env bash
# SPECBLOCK (a block-iterative drafter grows a dynamic draft tree, docs/specblock.md)
# on one GPU.
# usage: launch/specblock_gpu.sh [TARGET [DRAFTER]] [extra sglang / sgl-spec flags...]
#   TARGET: a model directory, hub id or shipped name (default: the shipped sgl-spec/tiny-code)
#   DRAFTER: the SpecBlock drafter (--specblock-drafter-path); needed with a TARGET of your own
#   (shipped: sgl-spec/tiny-code-specblock-narrow with --specblock-max-nodes 8)
#   GPU: the GPU to serve on (default 0)
# env: HOST (127.0.0.1), PORT (30000), PYTHON (.venv/bin/python); --dry-run or DRY_RUN=1
#      prints the command instead of running it (launch/_common.sh)
set -euo pipefail
# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"
launch_parse 2 "$@"
launch_exec --model-path "${POS[0]:-$SHIPPED_TARGET}" --speculative-algorithm SPECBLOCK \
    ${POS[1]:+--specblock-drafter-path "${POS[1]}"} \
    --device cuda --base-gpu-id "${GPU:-0}"
