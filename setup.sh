#!/usr/bin/env bash
# Idempotent: creates .venv/ at the repo root and installs sgl-spec (editable) with its test
# extras and the CPU start-up hook. A second run on a ready venv takes seconds.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
STAMP=.venv/.sgl-spec-setup

want=$(cat pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('sglang') and u.find_spec('sgl_spec')))"; then
    .venv/bin/python -m sgl_spec.cpu_kernels.install >/dev/null
    .venv/bin/python -m sgl_spec.cpu_kernels.native >/dev/null
    echo "setup.sh: .venv is up to date"
    exit 0
fi

# sglang==0.5.23 brings torch 2.14.1 and ~11 GB of wheels on a fresh machine (~5 min). Say so
# up front when the disk cannot hold them, rather than leave only pip's ENOSPC at the end.
need_gb=14
avail_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ -n "$avail_kb" ] && [ "$avail_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    echo "setup.sh: warning: $((avail_kb / 1024 / 1024)) GiB free under $(pwd);" \
        "installing sglang==0.5.23 and torch needs about $need_gb GiB" >&2
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# --no-cache-dir: a second copy of every wheel in pip's cache would double the disk it needs.
.venv/bin/python -m pip install --no-cache-dir --progress-bar off -e '.[test]'
.venv/bin/python -m sgl_spec.cpu_kernels.install
# the native CPU kernels for this host (a failed build is reported; the PyTorch ops serve)
.venv/bin/python -m sgl_spec.cpu_kernels.native
echo "$want" > "$STAMP"
echo "setup.sh: done"
