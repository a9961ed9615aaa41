#!/usr/bin/env bash
# Builds the offline kit for a GPU machine that has no package registry (docs/gpu.md): exactly
# the wheels that machine lacks (launch/gpu/kit.txt), for CPython 3.12 on manylinux x86_64, one
# version each, no dependencies pulled in, sglang and sglang-kernel slimmed by
# launch/gpu/slim_wheel.py, and DIR/MANIFEST.tsv (file, bytes, sha256). Fails when the kit
# exceeds KIT_MAX_MIB (default 45).
# usage: launch/gpu/build_kit.sh [DIR]     DIR defaults to .kit/ (git-ignored) at the repo root
#        PYTHON_VERSION=3.11 launch/gpu/build_kit.sh DIR   the same set for another CPython
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${1:-$ROOT/.kit}
PYTHON=${PYTHON:-python3}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
KIT_MAX_MIB=${KIT_MAX_MIB:-45}
LIST=$ROOT/launch/gpu/kit.txt

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT
rm -f "$DIR"/*.whl "$DIR"/MANIFEST.tsv

platforms=()
for n in 39 35 34 31 28 27 24 17 12 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

while read -r spec drops; do
    case "$spec" in ''|'#'*) continue ;; esac
    echo "build_kit: $spec"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check \
        --python-version "$PYTHON_VERSION" --implementation cp "${platforms[@]}" \
        --dest "$RAW/$spec" "$spec"
    wheel=$(ls "$RAW/$spec"/*.whl)
    if [ -z "$drops" ]; then
        mv "$wheel" "$DIR/"
        continue
    fi
    args=()
    for pattern in $drops; do args+=(--drop "$pattern"); done
    "$PYTHON" "$ROOT/launch/gpu/slim_wheel.py" "$wheel" "$DIR" "${args[@]}"
done < <(sed 's/#.*//' "$LIST")

"$PYTHON" - "$DIR" "$KIT_MAX_MIB" "$LIST" <<'EOF'
import hashlib, re, sys
from pathlib import Path

kit, limit, listing = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
wheels = sorted(kit.glob("*.whl"))
wanted = [line.split()[0] for line in listing.read_text().splitlines()
          if line.split("#")[0].strip()]
names = [re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() for w in wheels]
if len(set(names)) != len(names) or len(wheels) != len(wanted):
    sys.exit(f"build_kit: expected one wheel per line of {listing.name}, got {len(wheels)}")
total = 0
with open(kit / "MANIFEST.tsv", "w") as out:
    out.write("file\tbytes\tsha256\n")
    for wheel in wheels:
        data = wheel.read_bytes()
        total += len(data)
        out.write(f"{wheel.name}\t{len(data)}\t{hashlib.sha256(data).hexdigest()}\n")
mib = total / 2**20
print(f"build_kit: {len(wheels)} wheels, {mib:.1f} MiB in {kit} (limit {limit:g} MiB)")
if mib > limit:
    sys.exit(f"build_kit: the kit is {mib:.1f} MiB, over the {limit:g} MiB limit")
EOF
