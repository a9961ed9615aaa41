#!/usr/bin/env bash
# MINEDRAFT on a 2-GPU host: the target on GPU 0, the draft server on GPU 1 (its own process).
# usage: launch/minedraft_2gpu.sh TARGET DRAFT [extra sglang / sgl-spec flags...]
# TARGET / DRAFT: model directories, hub ids, or the shipped names (sgl-spec/tiny-code and
# sgl-spec/tiny-code-draft). MINEDRAFT serves --tp-size 1 only for now (the draft server is
# started by the scheduler of rank 0), so a host with more GPUs runs one such pair per server.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?target model}; DRAFT=${2:?draft model}; shift 2
exec .venv/bin/python -m sgl_spec.launch_server --model-path "$TARGET" \
    --speculative-algorithm MINEDRAFT --speculative-draft-model-path "$DRAFT" \
    --speculative-draft-device "${DRAFT_DEVICE:-cuda:1}" --base-gpu-id "${TARGET_GPU:-0}" \
    --speculative-num-steps "${NUM_STEPS:-3}" \
    --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}" "$@"
