"""Registers the fallback ops under the ``sgl_kernel`` op namespace with ``torch.library``.

Each op module exports ``OPS``: a list of ``OpDef`` (name, schema, implementation). The schema
is the upstream one (as called by SGLang 0.5.23 through the ``sgl_kernel`` Python wrappers and
``torch.ops.sgl_kernel``); ops already defined by a real ``sgl_kernel`` build are skipped so a
partially working native library is never shadowed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NAMESPACE = "sgl_kernel"


@dataclass(frozen=True)
class OpDef:
    name: str
    schema: str  # "(Tensor a, ...) -> ()" without the name
    impl: Callable[..., object]


_LIBS: list[torch.library.Library] = []


def _op_modules() -> list:
    from sgl_spec.cpu_kernels import attention, kvcache, layers, spec_ops, unsupported

    return [attention, kvcache, layers, spec_ops, unsupported]


def all_ops() -> list[OpDef]:
    ops: list[OpDef] = []
    for module in _op_modules():
        ops.extend(module.OPS)
    return ops


def _already_defined(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> list[str]:
    """Define and implement (CPU + CompositeExplicitAutograd) each op not yet defined."""
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    _LIBS.append(lib)
    registered = []
    for op in all_ops():
        if _already_defined(op.name):
            continue
        lib.define(op.name + op.schema)
        lib.impl(op.name, op.impl, "CPU")
        registered.append(op.name)
    from sgl_spec.cpu_kernels.layers import NO_TENSOR_OPS

    for op in NO_TENSOR_OPS:
        if _already_defined(op.name):
            continue
        lib.define(op.name + op.schema)
        lib.impl(op.name, op.impl, "CompositeExplicitAutograd")
        registered.append(op.name)
    return registered
