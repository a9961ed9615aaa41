#!/usr/bin/env bash
# No speculative decoding (the 'none' baseline) on a CPU-only host.
# usage: launch/none_cpu.sh [TARGET] [extra sglang / sgl-spec flags...]
#   TARGET: a model directory, hub id or shipped name (default: the shipped sgl-spec/tiny-code)
# env: HOST (127.0.0.1), PORT (30000), PYTHON (.venv/bin/python); --dry-run or DRY_RUN=1
#      prints the command instead of running it (launch/_common.sh)
set -euo pipefail
# shellcheck source=launch/_common.sh
source "$(dirname "$0")/_common.sh"
launch_parse 1 "$@"
launch_exec --model-path "${POS[0]:-$SHIPPED_TARGET}"
