#!/usr/bin/env bash
# The short GPU device check (docs/gpu.md): install the offline kit, then launch/gpu/check.py,
# every result in $OUT as it goes. Within 7 minutes on one H100/H200, install included.
# usage: launch/gpu/check.sh [KIT_DIR] [check.py flags...]   KIT_DIR defaults to .kit/
#        OUT defaults to .check-out/ when unset; PYTHON (python3) is the machine's interpreter;
#        CHECK_BUDGET_S (default 400) is what check.py may take after the install
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KIT=${1:-$ROOT/.kit}
[ $# -gt 0 ] && shift
OUT=${OUT:-$ROOT/.check-out}
VENV=${CHECK_VENV:-/tmp/sglspec-venv}
mkdir -p "$OUT"
start=$(date +%s)
{ nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
PYTHON=${PYTHON:-python3} "$ROOT/launch/gpu/install_kit.sh" "$KIT" "$VENV" > "$OUT/install.log" 2>&1 \
    || { tail -30 "$OUT/install.log"; exit 1; }
echo "check.sh: kit installed in $(( $(date +%s) - start ))s" | tee -a "$OUT/install.log"
exec "$VENV/bin/python" "$ROOT/launch/gpu/check.py" "$OUT" --budget-s "${CHECK_BUDGET_S:-400}" "$@"
