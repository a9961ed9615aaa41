"""Native float32 CPU kernels (``csrc/ops.cpp``, ``attention.cpp``, ``linear.cpp``,
``drafter.cpp``, ``drafter_heads.cpp``, ``drafter_kv.cpp``), built on
this host with the system C++ compiler.

The PyTorch ops in ``layers.py``, ``attention.py`` and ``spec_ops.py`` call these for the cases
they cover (RMSNorm, fused add + RMSNorm, SiLU-and-mul, neox RoPE, KV row stores, paged decode
and short extend attention, the KV slot table update) and keep their PyTorch path for
everything else, and wherever the library is missing.

The library is compiled for this CPU (``-march=native``) against this venv's torch, into
``<venv>/share/sgl_spec/native/`` (or ``$SGLSPEC_NATIVE_DIR``), under a name keyed by the
source, torch version, compiler flags and CPU flags, so a changed source, torch or host
never loads a stale build. ``./setup.sh`` and the launcher build it once
(``python -m sgl_spec.cpu_kernels.native``, about a minute on 2 cores); every other process
only loads what is there. ``SGLSPEC_CPU_NATIVE=0`` turns it off (pure PyTorch ops).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ENV_SWITCH = "SGLSPEC_CPU_NATIVE"
ENV_DIR = "SGLSPEC_NATIVE_DIR"
SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "ops.cpp", "attention.cpp", "linear.cpp", "drafter.cpp", "drafter_heads.cpp",
        "drafter_kv.cpp",
    )
)  # fmt: skip
HEADERS = (Path(__file__).with_name("csrc") / "common.h",)
NAMESPACE = "sgl_spec_native"
# -ffp-contract=off: no fused multiply-adds, so element-wise kernels round as PyTorch's do;
# -fno-trapping-math only lets loops with selects vectorise (no result changes)
CFLAGS = (
    "-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp",
    "-std=c++20", "-fPIC",
)  # fmt: skip

logger = logging.getLogger(__name__)
_state: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "false", "off")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def library_path() -> Path:
    """Where this host's build of the current source lives (whether or not it exists)."""
    import torch

    key = hashlib.sha256()
    for part in (*(s.read_bytes() for s in (*SOURCES, *HEADERS)), torch.__version__.encode(),
                 " ".join(CFLAGS).encode(), _compiler().encode(), _cpu_flags().encode()):  # fmt: skip
        key.update(part)
        key.update(b"\0")
    root = Path(os.environ.get(ENV_DIR) or Path(sys.prefix) / "share" / "sgl_spec" / "native")
    return root / f"{NAMESPACE}_{key.hexdigest()[:16]}.so"


def graph_cache_key() -> str:
    """A key for graphs torch.compile built around these ops: this host's build of the
    library (source, torch, flags, CPU) and the Python that shapes a traced forward (the
    fakes, our ops and SGLang patches). Inductor's own cache key sees neither a fake nor which
    graph inputs alias one storage, so a graph cached before either changed would be served
    after it."""
    key = hashlib.sha256(library_path().name.encode())
    package = Path(__file__).resolve().parents[1]
    for source in sorted((*package.glob("cpu_kernels/*.py"), *package.glob("patches/*.py"))):
        key.update(source.read_bytes())
    return key.hexdigest()[:16]


def _compile_command(out: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [_compiler(), *CFLAGS, "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-I{sysconfig.get_paths()['include']}", *map(str, SOURCES), "-o", str(out)]
    # torch's own libgomp: one OpenMP runtime in the process (same soname, loaded first)
    cmd += [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"]
    return cmd


def build(path: Path | None = None) -> Path:
    """Compile the library for this host unless a current build exists at ``path`` (default
    ``library_path()``); return the path.

    Several processes may build at once: each compiles to a temporary file and renames it
    into place, so a reader only ever sees a whole library."""
    path = path or library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run(_compile_command(Path(tmp)), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"compiling {', '.join(s.name for s in SOURCES)} failed:\n{proc.stderr[-4000:]}"
            )
        os.replace(tmp, path)
        for stale in path.parent.glob(f"{NAMESPACE}_*.so"):  # earlier sources' builds
            if stale != path:
                stale.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def ops() -> object | None:
    """``torch.ops.sgl_spec_native`` when enabled and built for this host, else None.

    Never builds: a missing build means the PyTorch ops (logged once)."""
    if "ops" in _state:
        return _state["ops"]
    result = None
    if enabled():
        import torch

        try:
            path = library_path()
            if path.exists():
                torch.ops.load_library(str(path))
                result = getattr(torch.ops, NAMESPACE)
                from sgl_spec.cpu_kernels import native_fakes

                native_fakes.register(result)
            else:
                logger.info("sgl_spec: no native CPU kernels built (%s); PyTorch ops", path)
        except (OSError, RuntimeError) as exc:
            logger.warning("sgl_spec: native CPU kernels not loaded (%s); PyTorch ops", exc)
    _state["ops"] = result
    return result


def ensure_built() -> Path | None:
    """Build when enabled, on a host without CUDA (where these ops serve the model), and
    missing; the launcher and setup call this. A failed build is logged, and the PyTorch ops
    serve."""
    import torch

    if not enabled() or torch.cuda.is_available():
        return None
    try:
        path = library_path()
        if not path.exists():
            logger.warning("sgl_spec: building native CPU kernels %s (once per host)", path)
        return build(path)
    except (OSError, RuntimeError) as exc:
        logger.warning("sgl_spec: native CPU kernels not built (%s); PyTorch ops serve", exc)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_built() or "native CPU kernels: not built")
