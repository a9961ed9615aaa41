"""PyTorch implementations of the ``sgl_kernel`` CPU ops SGLang's CPU engine calls.

Registered with ``torch.library`` under the upstream names and schemas (``sgl-kernel/csrc/cpu``)
only when the compiled library cannot load on a CPU-only host (see ``boot.py``). Every op is a
plain PyTorch reference, so tests compare them against dense attention.
"""

from __future__ import annotations

_registered = False


def register_all() -> None:
    """Define and implement every fallback op under ``torch.ops.sgl_kernel`` (idempotent)."""
    global _registered
    if _registered:
        return
    from sgl_spec.cpu_kernels import registry

    registry.register()
    _registered = True
