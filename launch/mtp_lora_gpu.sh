#!/usr/bin/env bash
# MTP_LORA (the target drafts its own next tokens through a gated LoRA, docs/mtp_lora.md)
# on one GPU.
# usage: launch/mtp_lora_gpu.sh [TARGET [ADAPTER]] [extra sglang / sgl-spec flags...]
#   TARGET: a model directory, hub id or shipped name (default: the shipped sgl-spec/tiny-code)
#   ADAPTER: the gated-LoRA adapter (--mtp-lora-path); needed with a TARGET of your own
#   (shipped: sgl-spec/tiny-code-mtp with --mtp-k auto); e.g. add --mtp-k 2 for a fixed k
#   GPU: the GPU to serve on (default 0)
# env: HOST (127.0.0.1), PORT (30000), PYTHON (.venv/bin/python); --dry-run or DRY_RUN=1
#      prints the command instead of running it (launch/_common.sh)
set -euo pipefail
# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"
launch_parse 2 "$@"
launch_exec --model-path "${POS[0]:-$SHIPPED_TARGET}" --speculative-algorithm MTP_LORA \
    ${POS[1]:+--mtp-lora-path "${POS[1]}"} \
    --device cuda --base-gpu-id "${GPU:-0}"
