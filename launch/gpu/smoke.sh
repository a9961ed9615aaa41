#!/usr/bin/env bash
# On a GPU machine with no package registry (docs/gpu.md): install the offline kit into a venv
# layered over the machine's own Python, then run launch/gpu/smoke.py (every algorithm served,
# greedy equality with `none`, identical-draft acceptance, bench_speculative at concurrency 1
# and 16, gamma_tolerance), every result in $OUT. Within ~25 minutes on one H100.
# usage: launch/gpu/smoke.sh [KIT_DIR] [smoke.py flags...]   KIT_DIR defaults to .kit/
#        OUT defaults to .smoke-out/ when unset; PYTHON (python3) is the machine's interpreter
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KIT=${1:-$ROOT/.kit}
[ $# -gt 0 ] && shift
OUT=${OUT:-$ROOT/.smoke-out}
VENV=${SMOKE_VENV:-/tmp/sglspec-venv}
mkdir -p "$OUT"
{ nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
start=$(date +%s)
PYTHON=${PYTHON:-python3} "$ROOT/launch/gpu/install_kit.sh" "$KIT" "$VENV" 2>&1 | tee "$OUT/install.log"
echo "smoke.sh: kit installed in $(( $(date +%s) - start ))s" | tee -a "$OUT/install.log"
exec "$VENV/bin/python" "$ROOT/launch/gpu/smoke.py" "$OUT" "$@"
