"""Registers the fallback ops under the ``sgl_kernel`` op namespace with ``torch.library``.

Each op module exports ``OPS``: a list of ``OpDef`` (name, schema, implementation). The schema
is the upstream one (as called by SGLang 0.5.23 through the ``sgl_kernel`` Python wrappers and
``torch.ops.sgl_kernel``); ops already defined by a real ``sgl_kernel`` build are skipped so a
partially working native library is never shadowed.
"""

from __future__ import annotations

import torch

from sgl_spec.cpu_kernels.opdef import OpDef

NAMESPACE = "sgl_kernel"


_LIBS: list[torch.library.Library] = []


def _op_modules() -> list:
    from sgl_spec.cpu_kernels import (
        attention,
        collectives,
        kvcache,
        layers,
        spec_ops,
        unsupported,
    )

    return [attention, collectives, kvcache, layers, spec_ops, unsupported]


def all_ops() -> list[OpDef]:
    ops: list[OpDef] = []
    for module in _op_modules():
        ops.extend(module.OPS)
    return ops


def op_defined(name: str) -> bool:
    """Whether ``torch.ops.sgl_kernel.<name>`` exists (a native build's or ours)."""
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> list[str]:
    """Define and implement each op not yet defined: the CPU ops for the CPU dispatch key; the
    tensor-free ops, and on a CUDA host the CUDA path's ops (``cuda_ops``), for every device."""
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    _LIBS.append(lib)
    registered = []
    for op in all_ops():
        if op_defined(op.name):
            continue
        lib.define(op.name + op.schema)
        lib.impl(op.name, op.impl, "CPU")
        registered.append(op.name)
    from sgl_spec.cpu_kernels.cuda_ops import OPS as CUDA_PATH_OPS
    from sgl_spec.cpu_kernels.layers import NO_TENSOR_OPS

    # the CUDA path's ops only where CUDA is: on a CPU host SGLang must keep seeing exactly the
    # op set of a CPU build of sgl_kernel
    cuda_ops = CUDA_PATH_OPS if torch.cuda.is_available() else []
    for op in [*NO_TENSOR_OPS, *cuda_ops]:
        if op_defined(op.name):
            continue
        lib.define(op.name + op.schema)
        lib.impl(op.name, op.impl, "CompositeExplicitAutograd")
        registered.append(op.name)
    return registered
