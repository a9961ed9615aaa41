#!/usr/bin/env bash
# Installs the offline kit (build_kit.sh) and this checkout into VENV, a venv layered over the
# Python environment of PYTHON (the GPU machine's own: its torch, triton, transformers, ...),
# with no network. VENV sees PYTHON's site-packages after its own, so the kit's wheels win and
# nothing of the machine's environment is changed. Checks every wheel against MANIFEST.tsv.
# usage: launch/gpu/install_kit.sh KIT_DIR VENV        (PYTHON defaults to python3)
#        then: VENV/bin/python -m sgl_spec.launch_server ...
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KIT=$(cd "${1:?usage: install_kit.sh KIT_DIR VENV}" && pwd)
VENV=${2:?usage: install_kit.sh KIT_DIR VENV}
PYTHON=${PYTHON:-python3}

(cd "$KIT" && tail -n +2 MANIFEST.tsv | awk -F'\t' '{print $3 "  " $1}' | sha256sum -c --quiet)

"$PYTHON" -m venv --without-pip --clear "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The base environment is often a venv itself (then `venv --system-site-packages` would reach
# past it to the bare interpreter): add its site directories explicitly, .pth files included.
"$PYTHON" -c 'import site, sys; print("import site; " + "; ".join(
    f"site.addsitedir({p!r})" for p in site.getsitepackages()))' > "$site/_sglspec_base_env.pth"

pip=("$PYTHON" -m pip --python "$VENV/bin/python" install --no-index --no-deps --no-cache-dir
    --disable-pip-version-check --quiet)
"${pip[@]}" "$KIT"/*.whl
# sgl-spec itself, editable (no weights needed; setuptools comes from the base environment)
"${pip[@]}" --no-build-isolation -e "$ROOT"
"$VENV/bin/python" -m sgl_spec.cpu_kernels.install >/dev/null
"$VENV/bin/python" -c 'import sglang, sgl_spec, torch; print(
    f"install_kit: sglang {sglang.__version__}, torch {torch.__version__}, sgl_spec ready")'
