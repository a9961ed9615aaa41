"""Patch: float32 linear layers on the CPU run MKL's packed GEMM (weights packed once at load).

Upstream target: ``sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod``
(SGLang 0.5.23). SGLang's CPU engine packs bfloat16/float16/int8 weights for its AMX kernels
(``amx_utils.dtype_is_supported``); a float32 weight is left to ``F.linear``, which at the
4-16 row shapes of verify and draft passes took 1.2-1.7x the time of MKL's GEMM on a weight
packed ahead of time (``benchmarks/RESULTS.md``, "Packed float32 GEMMs"). After SGLang's own
``process_weights_after_loading`` this patch packs each remaining float32 CPU weight with
``torch.ops.mkl._mkl_reorder_linear_weight`` and ``apply`` multiplies with
``torch.ops.mkl._mkl_linear``, the pair PyTorch's inductor uses for frozen float32 linears.

Calls of fewer than ``MIN_ROWS`` rows (a single decode) keep ``F.linear``, whose GEMV path
measures as fast there; from ``MIN_ROWS`` rows on (verify, draft and prefill passes, larger
decode batches) the packed weight is used. At the widths of real layers (512 and above in
and out; ``tests/unit/test_patches.py``) a packed call computes each row the same way whatever
the number of rows, as ``F.linear`` does not. A weight changed in place after loading (a
weight update) is packed again before its next use. It stands aside under ``torch.compile``
and where PyTorch has no MKL.

Off unless ``SGLSPEC_CPU_PACKED_LINEAR=1``: with it SPECBLOCK served 1.09x faster at
concurrency 1, but ``none``, whose single-row decodes it leaves on ``F.linear``, measured
0.85-0.95x of ``none`` without it in three runs, unexplained (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from types import ModuleType

import torch

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.layers.quantization.unquant"
ENV_SWITCH = "SGLSPEC_CPU_PACKED_LINEAR"
_PACK_ROWS = 16  # row-count hint for the packing; any row count can use the packed weight
MIN_ROWS = 4  # below this F.linear measured as fast (1-2 rows: packed 1.02x its time)


def enabled(config: SpecConfig) -> bool:
    return os.environ.get(ENV_SWITCH, "0") == "1"


def available() -> bool:
    """PyTorch was built with MKL and exposes the packed-linear pair."""
    mkl = getattr(torch.ops, "mkl", None)
    return (
        torch.backends.mkl.is_available()
        and mkl is not None
        and hasattr(mkl, "_mkl_reorder_linear_weight")
        and hasattr(mkl, "_mkl_linear")
    )


class PackedWeight:
    """A layer's weight packed for MKL, remembered with the version it was packed from."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.key = _weight_key(weight)
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_ROWS)


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version


def packable(layer: torch.nn.Module) -> bool:
    weight = getattr(layer, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not getattr(layer, "use_intel_amx_backend", False)
    )


def pack(layer: torch.nn.Module) -> None:
    """Pack ``layer.weight`` if it is a float32 CPU weight no SGLang kernel packed."""
    if packable(layer):
        layer._sgl_spec_packed = PackedWeight(layer.weight)


def packed_linear(
    layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x @ W.T + bias`` with the packed weight; ``None`` when this call cannot use it."""
    if x.numel() < MIN_ROWS * x.shape[-1]:  # first: a single decode pays only this
        return None
    state: PackedWeight | None = getattr(layer, "_sgl_spec_packed", None)
    weight = layer.weight
    if state is None or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return None
    if bias is not None and bias.dtype != torch.float32:
        return None
    if state.key != _weight_key(weight):  # changed in place since it was packed
        state = PackedWeight(weight)
        layer._sgl_spec_packed = state
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkl._mkl_linear(rows, state.packed, weight, bias, rows.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


def _module() -> ModuleType:
    import importlib

    return importlib.import_module(TARGET)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    cls = getattr(_module(), "UnquantizedLinearMethod", None)
    if cls is None:
        raise RuntimeError(f"{TARGET}.UnquantizedLinearMethod is gone")
    for name, expected in (
        ("process_weights_after_loading", ["self", "layer"]),
        ("apply", ["self", "layer", "x", "bias"]),
    ):
        method = getattr(cls, name, None)
        if method is None:
            raise RuntimeError(f"{TARGET}.UnquantizedLinearMethod.{name} is gone")
        params = list(inspect.signature(getattr(method, "__wrapped__", method)).parameters)
        if params != expected:
            raise RuntimeError(f"{TARGET}.UnquantizedLinearMethod.{name} params: {params}")


def packing(original: Callable) -> Callable:
    """``process_weights_after_loading`` followed by :func:`pack`."""

    @functools.wraps(original)
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        original(self, layer)
        pack(layer)

    process_weights_after_loading._sgl_spec_packed_linear = True  # type: ignore[attr-defined]
    return process_weights_after_loading


def applying(original: Callable) -> Callable:
    """``apply`` through the packed weight where the layer has one."""

    @functools.wraps(original)
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
        out = packed_linear(layer, x, bias)
        return original(self, layer, x, bias) if out is None else out

    apply._sgl_spec_packed_linear = True  # type: ignore[attr-defined]
    return apply


def apply() -> bool:
    """Wrap both methods (subclasses inherit them); idempotent. False where MKL is missing."""
    check()
    if not available():
        return False
    cls = _module().UnquantizedLinearMethod
    if not getattr(cls.process_weights_after_loading, "_sgl_spec_packed_linear", False):
        cls.process_weights_after_loading = packing(cls.process_weights_after_loading)
    if not getattr(cls.apply, "_sgl_spec_packed_linear", False):
        cls.apply = applying(cls.apply)
    return True
