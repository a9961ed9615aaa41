"""Patch: float32 linear layers and the LM head through oneDNN on CPU hosts.

Upstream targets (SGLang 0.5.23): ``sglang.srt.layers.quantization.unquant``'s
``UnquantizedLinearMethod.apply`` and ``sglang.srt.layers.logits_processor``'s
``LogitsProcessor._compute_lm_head``. For float32 weights SGLang's CPU engine does not pack
(``amx_utils.dtype_is_supported`` takes 16-bit and 8-bit types only), so every projection runs
``F.linear`` / ``torch.matmul``, i.e. MKL's sgemm. MKL picks slow kernels on non-Intel x86 CPUs
and at few rows repacks the weight on every call; oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``, the op inductor's freezing pass emits) reads the plain
row-major weight as it is, so nothing is converted at load and no memory is added.
``benchmarks/forward_cost.py`` measures what it changes in a served forward.

Both wrappers fall through to upstream for everything else: other dtypes, other devices,
modules SGLang already packs (``use_intel_amx_backend``), LoRA-wrapped or quantized LM heads,
weights that need gradients, and empty batches. Like MKL, oneDNN's bits for a row may depend
on how many rows share the call; greedy losslessness does not rest on row bits being equal
across batch shapes (a 1-row decode and an n-row verify already differ under MKL).
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType

import torch

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.layers.quantization.unquant"
LOGITS_TARGET = "sglang.srt.layers.logits_processor"


def enabled(config: SpecConfig) -> bool:
    return config.cpu_linear == "onednn"


def _modules() -> tuple[ModuleType, ModuleType]:
    import importlib

    return importlib.import_module(TARGET), importlib.import_module(LOGITS_TARGET)


def onednn_usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``x @ weight.T + bias`` can go to oneDNN: float32 on CPU, dense 2-D weight,
    inference only, at least one row."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.layout == torch.strided
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and x.numel() > 0
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"))
    )


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN's inner product (callers check
    ``onednn_usable``)."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    unquant, logits = _modules()
    apply_params = list(inspect.signature(unquant.UnquantizedLinearMethod.apply).parameters)
    if apply_params != ["self", "layer", "x", "bias"]:
        raise RuntimeError(f"{TARGET}.UnquantizedLinearMethod.apply params changed: {apply_params}")
    head_params = list(inspect.signature(logits.LogitsProcessor._compute_lm_head).parameters)
    if head_params != ["self", "hidden_states", "lm_head", "embedding_bias", "out"]:
        raise RuntimeError(
            f"{LOGITS_TARGET}.LogitsProcessor._compute_lm_head params changed: {head_params}"
        )
    if not hasattr(unquant, "_is_cpu"):
        raise RuntimeError(f"{TARGET} lacks _is_cpu: patch cpu_onednn_linear needs updating")
    for name in ("use_intel_amx_backend", "should_apply_lm_head_quant_method"):
        if not hasattr(logits, name) and not hasattr(unquant, name):
            raise RuntimeError(f"SGLang lacks {name}: patch cpu_onednn_linear needs updating")
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        raise RuntimeError("torch lacks mkldnn._linear_pointwise: patch cpu_onednn_linear")


def _plain_lm_head(processor: object, lm_head: torch.nn.Module) -> bool:
    """The LM head takes upstream's plain ``torch.matmul`` branch (no LoRA, quantization,
    packing or bf16 on-policy head)."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
    from sglang.srt.utils.common import use_intel_amx_backend

    if hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"):
        return False
    if should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None)):
        return False
    return (
        hasattr(lm_head, "weight")
        and not use_intel_amx_backend(lm_head)
        and getattr(processor, "rl_on_policy_target", None) is None
    )


def apply() -> bool:
    """Route float32 CPU linears and LM heads to oneDNN; False (nothing changed) off CPU or
    without oneDNN."""
    check()
    unquant, logits = _modules()
    if not unquant._is_cpu or not torch.backends.mkldnn.is_available():
        return False
    method = unquant.UnquantizedLinearMethod
    if getattr(method.apply, "_sgl_spec_onednn", False):
        return True
    from sglang.srt.utils.common import use_intel_amx_backend

    original_apply = method.apply

    @functools.wraps(original_apply)
    def linear_apply(
        self: object, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = layer.weight
        if not use_intel_amx_backend(layer) and onednn_usable(x, weight, bias):
            return onednn_linear(x, weight, bias)
        return original_apply(self, layer, x, bias)

    linear_apply._sgl_spec_onednn = True  # type: ignore[attr-defined]
    method.apply = linear_apply

    processor = logits.LogitsProcessor
    original_head = processor._compute_lm_head

    @functools.wraps(original_head)
    def compute_lm_head(
        self: object,
        hidden_states: torch.Tensor,
        lm_head: torch.nn.Module,
        embedding_bias: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weight = getattr(lm_head, "weight", None)
        if (
            weight is not None
            and _plain_lm_head(self, lm_head)
            and onednn_usable(hidden_states, weight, None)
        ):
            return onednn_linear(hidden_states, weight)
        return original_head(self, hidden_states, lm_head, embedding_bias, out=out)

    processor._compute_lm_head = compute_lm_head
    return True
