#!/usr/bin/env bash
# Serve a target with SGLang's STANDALONE speculative decoding on a CPU-only host.
# usage: launch/cpu_standalone.sh TARGET_DIR DRAFT_DIR [extra sglang flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?target model dir}; DRAFT=${2:?draft model dir}; shift 2
exec .venv/bin/python -m sgl_spec.launch_server --model-path "$TARGET" \
    --speculative-algorithm STANDALONE --speculative-draft-model-path "$DRAFT" \
    --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
    --host 127.0.0.1 --port "${PORT:-30000}" "$@"
