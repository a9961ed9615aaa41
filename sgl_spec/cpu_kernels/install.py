"""Installs the one-line ``.pth`` start-up hook (see ``boot.py``) into site-packages.

``./setup.sh`` runs ``python -m sgl_spec.cpu_kernels.install``; ``launch_server`` calls
``ensure_boot_hook`` so a plain ``pip install`` also works. Idempotent.
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

PTH_NAME = "sgl_spec_cpu_kernels.pth"
PTH_LINE = "import sgl_spec.cpu_kernels.boot\n"

logger = logging.getLogger(__name__)


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def ensure_boot_hook() -> Path:
    """Write the .pth file if it is missing or stale; return its path."""
    path = pth_path()
    if not path.exists() or path.read_text() != PTH_LINE:
        try:
            path.write_text(PTH_LINE)
            logger.warning("sgl_spec: installed start-up hook %s", path)
        except OSError as exc:  # read-only site-packages: spawned processes will lack the hook
            logger.warning(
                "sgl_spec: cannot write %s (%s); run `python -m sgl_spec.cpu_kernels.install`"
                " with write access, or CPU-only hosts cannot import sgl_kernel",
                path,
                exc,
            )
    import sgl_spec.cpu_kernels.boot  # noqa: F401  (this process, if started before the hook)

    return path


if __name__ == "__main__":
    print(ensure_boot_hook())
