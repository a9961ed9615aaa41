#!/usr/bin/env bash
# CPU dry run of the offline GPU kit (docs/gpu.md). CI does not run it: it downloads ~4 GB.
#   1. WORK/base: a fresh CPython 3.12 venv holding only launch/gpu/gpu_image.txt, i.e. what the
#      GPU machine holds (torch 2.11's CUDA wheel, triton 3.6, transformers 5.17, ...);
#   2. WORK/kit: launch/gpu/build_kit.sh, the wheels that machine lacks;
#   3. WORK/venv: launch/gpu/install_kit.sh, offline, layered over WORK/base;
#   4. `WORK/venv/bin/python -m sgl_spec.launch_server` (the shipped models, STANDALONE_FULL) on the
#      CPU serves one greedy request, whose tokens must equal those of ./setup.sh's .venv when
#      it is there; with --smoke, also launch/gpu/smoke.py on the CPU (tiny models).
#   With --check instead of 4: launch/gpu/check.sh (install + check.py, tiny models) timed
#   whole, as the GPU machine runs it; fails past CHECK_LIMIT_S (default 420).
# usage: launch/gpu/dryrun_cpu.sh [--smoke|--check] [WORK]   WORK defaults to .dryrun/ (ignored)
#        PY312=/path/to/python3.12 to choose the interpreter
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SMOKE=0
CHECK=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
if [ "${1:-}" = "--check" ]; then CHECK=1; shift; fi
WORK=${1:-$ROOT/.dryrun}
PY312=${PY312:-python3.12}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
IMAGE=$ROOT/launch/gpu/gpu_image.txt

if [ ! -x "$WORK/base/bin/python" ]; then
    "$PY312" -m venv "$WORK/base"
    grep -E '^(torch|triton|torchvision)==' "$IMAGE" > "$WORK/torch.txt"
    # torch with its CUDA libraries (on the image too), then the rest exactly as listed
    "$WORK/base/bin/python" -m pip install -q --disable-pip-version-check -r "$WORK/torch.txt"
    "$WORK/base/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$IMAGE"
fi
"$ROOT/launch/gpu/build_kit.sh" "$WORK/kit"
if [ "$CHECK" = 1 ]; then
    rm -rf "$WORK/check" "$WORK/venv-check"
    start=$(date +%s)
    status=0
    OUT="$WORK/check" CHECK_VENV="$WORK/venv-check" PYTHON="$WORK/base/bin/python" \
        "$ROOT/launch/gpu/check.sh" "$WORK/kit" --device cpu || status=$?
    wall=$(( $(date +%s) - start ))
    echo "dryrun: check.sh exited $status after ${wall}s (limit ${CHECK_LIMIT_S:-420}s)"
    [ "$status" = 0 ] && [ "$wall" -le "${CHECK_LIMIT_S:-420}" ] || exit 1
    echo "dryrun: passed"
    exit 0
fi
PYTHON="$WORK/base/bin/python" "$ROOT/launch/gpu/install_kit.sh" "$WORK/kit" "$WORK/venv"

port=${PORT:-31990}
log=$WORK/server.log
request='{"text": "def wrap(text, width):", "sampling_params": {"temperature": 0, "max_new_tokens": 24}}'
(cd "$WORK" && exec "$WORK/venv/bin/python" -m sgl_spec.launch_server --port "$port" \
    --max-total-tokens 4096 > "$log" 2>&1) &
server=$!
trap 'kill -- -$server 2>/dev/null || kill $server 2>/dev/null || true; pkill -f "port $port" || true' EXIT
for _ in $(seq 1 300); do
    curl -sf "localhost:$port/health_generate" >/dev/null && break
    kill -0 $server 2>/dev/null || { tail -40 "$log"; echo "dryrun: server died" >&2; exit 1; }
    sleep 2
done
out=$(curl -sf "localhost:$port/generate" -H 'Content-Type: application/json' -d "$request")
ids=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["output_ids"])' "$out")
echo "dryrun: kit venv served: $ids"
grep -E "sgl_spec: applied patches|Ignore import error|disabled" "$log" | sed 's/^/dryrun: log: /' || true
pkill -f "port $port" || true

if [ -x "$ROOT/.venv/bin/python" ]; then
    ref=$(cd "$ROOT" && .venv/bin/python - "$request" <<'EOF'
import json, sys
sys.path[:0] = [".", "benchmarks"]
from tests.helpers.server_utils import Server  # the test suite's launcher wrapper
from pathlib import Path
import tempfile
with tempfile.TemporaryDirectory() as tmp:
    server = Server([], Path(tmp) / "server.log")
    try:
        print(server.generate(json.loads(sys.argv[1]))["output_ids"])
    finally:
        server.stop()
EOF
)
    echo "dryrun: .venv served:     $ref"
    [ "$ids" = "$ref" ] || { echo "dryrun: FAILED: the kit venv's tokens differ" >&2; exit 1; }
fi
if [ "$SMOKE" = 1 ]; then
    "$WORK/venv/bin/python" "$ROOT/launch/gpu/smoke.py" "$WORK/smoke" --device cpu
fi
echo "dryrun: passed"
