"""Patch: float32 linear layers on the CPU run on weights packed once at load.

Upstream target: ``sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod``
(SGLang 0.5.23). SGLang's CPU engine packs bfloat16/float16/int8 weights for its AMX kernels
(``amx_utils.dtype_is_supported``); a float32 weight is left to ``F.linear``, whose MKL GEMM
takes 1.4-2.5x the 1-row time at the 4-16 rows of verify and draft passes, although reading
the weights once bounds those shapes (``benchmarks/RESULTS.md``). After SGLang's own
``process_weights_after_loading`` this patch packs each remaining float32 CPU weight, and
``apply`` multiplies with the packed copy, by one of two kernels (``SGLSPEC_CPU_PACKED_LINEAR``):

- ``native`` (the default where our native CPU library is built and the CPU has AVX-512, or
  AVX2 with FMA):
  ``sgl_spec_native.packed_linear`` (``cpu_kernels/csrc/linear.cpp``) serves every call of 1 to
  ``native_max_rows()`` rows (decodes, verify and draft passes) in about one pass over the
  weights; more rows (prefill) keep ``F.linear``. Each output is one float32 sum in input
  order whatever the row count, so a verify row computes exactly what a decode of that row
  computes in these layers.
- ``mkl`` (opt-in): MKL's packed GEMM (``torch.ops.mkl._mkl_linear``, what PyTorch's inductor
  uses for frozen float32 linears) from ``MKL_MIN_ROWS`` rows on; fewer rows keep ``F.linear``.
  In three runs ``none`` measured 0.85-0.95x of ``none`` without it, unexplained.

``0`` turns the patch off. The packed copy is held beside the weight (the weight stays the
parameter SGLang and the algorithms read); a weight changed in place after loading (a weight
update) is packed again before its next use. The patch stands aside under ``torch.compile``.
Its second target, the float32 LM head (``LogitsProcessor._compute_lm_head``), is in
``cpu_packed_lm_head.py``: checked and applied with this patch, on the same kernel.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from types import ModuleType

import torch

from sgl_spec.config import SpecConfig
from sgl_spec.patches import cpu_packed_lm_head as lm_head

TARGET = ("sglang.srt.layers.quantization.unquant", "sglang.srt.layers.logits_processor")
ENV_SWITCH = "SGLSPEC_CPU_PACKED_LINEAR"
KINDS = ("native", "mkl")
_MKL_PACK_ROWS = 16  # row-count hint for MKL's packing; any row count can use the packed weight
MKL_MIN_ROWS = 4  # below this F.linear measured as fast as MKL's packed GEMM
NATIVE_MAX_ROWS = 64  # beyond this (prefill) MKL's GEMM measured as fast or faster (AVX-512)
# without AVX-512 the native kernel measured 1.1-1.9x faster than MKL's GEMM up to 256 rows
NATIVE_MAX_ROWS_AVX2 = 256


@functools.cache
def _isa() -> frozenset[str]:
    from sgl_spec.cpu_kernels.native import _cpu_flags

    return frozenset(_cpu_flags().split())


def native_max_rows() -> int:
    """The most rows a call sends to the native kernel on this CPU."""
    return NATIVE_MAX_ROWS if "avx512f" in _isa() else NATIVE_MAX_ROWS_AVX2


def kind() -> str | None:
    """The kernel ``SGLSPEC_CPU_PACKED_LINEAR`` asks for: ``auto`` (unset) is ``native`` where
    it is available and the CPU has AVX-512 or AVX2 with FMA, else none; ``1`` is the older
    spelling of ``mkl``; ``0`` is none. Raises on any other value."""
    value = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if value in ("0", "off", "false"):
        return None
    if value == "1":
        return "mkl"
    if value == "auto":
        return "native" if available("native") and has_vector_fma() else None
    if value not in KINDS:
        raise ValueError(f"{ENV_SWITCH}={value!r}: expected auto, native, mkl or 0")
    return value


def enabled(config: SpecConfig) -> bool:
    return kind() is not None


def has_vector_fma() -> bool:
    """AVX-512, or AVX2 with FMA: the vector widths the native kernel is tiled for."""
    return "avx512f" in _isa() or {"avx2", "fma"} <= _isa()


def available(which: str) -> bool:
    """``which`` kernel can run here: the native library is loaded (``native``), or PyTorch
    has MKL's packed-linear pair (``mkl``)."""
    if which == "native":
        from sgl_spec.cpu_kernels import native

        ops = native.ops()
        return ops is not None and hasattr(ops, "packed_linear")
    mkl = getattr(torch.ops, "mkl", None)
    return (
        torch.backends.mkl.is_available()
        and mkl is not None
        and hasattr(mkl, "_mkl_reorder_linear_weight")
        and hasattr(mkl, "_mkl_linear")
    )


class PackedWeight:
    """A layer's weight packed for one kernel, remembered with the version it was packed from."""

    def __init__(self, weight: torch.Tensor, which: str) -> None:
        self.key = _weight_key(weight)
        self.kind = which
        # read here once: torch.compile cannot trace the CPU-flag lookup behind it
        self.max_rows = native_max_rows() if which == "native" else None
        if which == "native":
            from sgl_spec.cpu_kernels import native

            self.packed = native.ops().pack_linear_weight(weight.detach())
        else:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _MKL_PACK_ROWS)

    def takes(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows goes through this packed weight."""
        if self.max_rows is not None:
            return rows <= self.max_rows
        return rows >= MKL_MIN_ROWS

    def linear(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.kind == "native":
            return torch.ops.sgl_spec_native.packed_linear(rows, self.packed, weight.shape[0], bias)
        return torch.ops.mkl._mkl_linear(rows, self.packed, weight, bias, rows.shape[0])


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


def pack(layer: torch.nn.Module, which: str | None = None) -> None:
    """Pack ``layer.weight`` for ``which`` kernel (default: :func:`kind`) if it is a float32
    CPU weight no SGLang kernel packed."""
    which = which or kind()
    if which is not None and packable(layer):
        layer._sgl_spec_packed = PackedWeight(layer.weight, which)


def packed_linear(
    layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x @ W.T + bias`` with the packed weight; ``None`` when this call cannot use it."""
    state: PackedWeight | None = getattr(layer, "_sgl_spec_packed", None)
    compiling = torch.compiler.is_compiling()
    if state is None or (compiling and state.kind != "native"):
        return None  # the native op has a fake for torch.compile to trace; MKL's pair not here
    if not x.shape[-1] or not state.takes(x.numel() // x.shape[-1]):
        return None
    weight = layer.weight
    if x.dtype != torch.float32:
        return None
    if bias is not None and bias.dtype != torch.float32:
        return None
    # a traced graph cannot read a data pointer, and holds its weights as constants anyway
    if not compiling:
        state = current(layer)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    return state.linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def current(layer: torch.nn.Module) -> PackedWeight:
    """The packed weight of a packed ``layer`` (:func:`pack`), packed again first if the
    weight changed since (in place: a weight update)."""
    state: PackedWeight = layer._sgl_spec_packed
    if state.key != _weight_key(layer.weight):
        state = PackedWeight(layer.weight, state.kind)
        layer._sgl_spec_packed = state
    return state


def linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias``: :func:`packed_linear` where it serves the call, else ``F.linear``."""
    out = packed_linear(layer, x, bias)
    return torch.nn.functional.linear(x, layer.weight, bias) if out is None else out


def _packed_module_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        # the native kernel has no backward: a pass that trains (online adaptation) keeps
        # F.linear
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return linear(self, x, self.bias)


def pack_linear_modules(module: torch.nn.Module, which: str | None = None) -> int:
    """Serve every float32 CPU ``nn.Linear`` under ``module`` (a model SGLang does not load,
    such as SPECBLOCK's drafter) through the packed kernel: each layer's weight is packed once
    and its calls of the rows the kernel takes use it, others ``F.linear``. Returns how many
    layers were packed (0 where no kernel is available or the weights are not float32 CPU)."""
    which = which or kind()
    if which is None or not available(which):
        return 0
    count = 0
    for layer in module.modules():
        if type(layer) is torch.nn.Linear and packable(layer):
            pack(layer, which)
            layer.forward = _packed_module_forward.__get__(layer)
            count += 1
    return count


def _module() -> ModuleType:
    import importlib

    return importlib.import_module(TARGET[0])


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    cls = getattr(_module(), "UnquantizedLinearMethod", None)
    if cls is None:
        raise RuntimeError(f"{TARGET[0]}.UnquantizedLinearMethod is gone")
    for name, expected in (
        ("process_weights_after_loading", ["self", "layer"]),
        ("apply", ["self", "layer", "x", "bias"]),
    ):
        method = getattr(cls, name, None)
        if method is None:
            raise RuntimeError(f"{TARGET[0]}.UnquantizedLinearMethod.{name} is gone")
        params = list(inspect.signature(getattr(method, "__wrapped__", method)).parameters)
        if params != expected:
            raise RuntimeError(f"{TARGET[0]}.UnquantizedLinearMethod.{name} params: {params}")
    lm_head.check()


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
    """Wrap both methods (subclasses inherit them); idempotent. False where the chosen kernel
    is missing."""
    check()
    which = kind()
    if which is None or not available(which):
        return False
    cls = _module().UnquantizedLinearMethod
    if not getattr(cls.process_weights_after_loading, "_sgl_spec_packed_linear", False):
        cls.process_weights_after_loading = packing(cls.process_weights_after_loading)
    if not getattr(cls.apply, "_sgl_spec_packed_linear", False):
        cls.apply = applying(cls.apply)
    lm_head.apply(pack, packed_linear)
    return True
