"""Part of the ``cpu_packed_linear`` patch: the float32 LM head on the CPU runs on a packed
weight, like the linear layers.

Upstream target: ``sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head``
(SGLang 0.5.23), the second target of ``cpu_packed_linear``, which checks and applies this. The LM head is a ``VocabParallelEmbedding`` (often the input embedding
itself, tied), not a linear layer, so ``cpu_packed_linear`` never sees it: a float32 head
takes upstream's last branch, ``torch.matmul(hidden, weight.T)`` (MKL), whose cost grows with
the rows of a verify block (on a 2-vCPU AMD host a 4-row head of the shipped target measured
~3 ms against ~0.8 ms at 1 row, `benchmarks/RESULTS.md`). Where upstream would take that
branch, the head is packed on first use (a copy beside the weight, which stays what the
embedding lookup reads) and multiplied by the same kernel as the linear layers
(``cpu_packed_linear.packed_linear``, its row limit): every logit is then one float32 sum in
input order whatever the row count, so a verify row's logits equal a decode's. LoRA-wrapped,
quantized, AMX-packed, fp32-upcast and RL on-policy heads keep upstream's path; so does any
call the kernel does not take (more rows than its limit, a dtype other than float32).
On with ``cpu_packed_linear`` (``SGLSPEC_CPU_PACKED_LINEAR``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType

import torch

TARGET = "sglang.srt.layers.logits_processor"
_PARAMS = ["self", "hidden_states", "lm_head", "embedding_bias", "out"]


_UPSTREAM: dict[str, ModuleType] = {}  # the target module, looked up once


def _module() -> ModuleType:
    """The target module, imported on the first call; a dict read after that, which
    torch.compile traces (it cannot trace ``import_module``)."""
    module = _UPSTREAM.get("module")
    if module is None:
        import importlib

        module = _UPSTREAM["module"] = importlib.import_module(TARGET)
    return module


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    module = _module()
    cls = getattr(module, "LogitsProcessor", None)
    method = getattr(cls, "_compute_lm_head", None)
    if method is None:
        raise RuntimeError(f"{TARGET}.LogitsProcessor._compute_lm_head is gone")
    params = list(inspect.signature(getattr(method, "__wrapped__", method)).parameters)
    if params != _PARAMS:
        raise RuntimeError(f"{TARGET}.LogitsProcessor._compute_lm_head params: {params}")
    for name in ("should_apply_lm_head_quant_method", "use_intel_amx_backend"):
        if not callable(getattr(module, name, None)):
            raise RuntimeError(f"{TARGET}.{name} is gone: patch cpu_packed_lm_head")
    source = inspect.getsource(getattr(method, "__wrapped__", method))
    if "hidden_states.to(lm_head.weight.dtype), lm_head.weight.T" not in source:
        raise RuntimeError(f"{TARGET}.LogitsProcessor._compute_lm_head changed")


def plain_head(processor: object, lm_head: torch.nn.Module, hidden: torch.Tensor) -> bool:
    """Upstream would multiply ``hidden`` by this head's weight with ``torch.matmul``."""
    module = _module()
    weight = getattr(lm_head, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not module.should_apply_lm_head_quant_method(
            lm_head, getattr(lm_head, "quant_method", None)
        )
        and not hidden.is_cuda
        and not getattr(processor, "use_fp32_lm_head", False)
        and not module.use_intel_amx_backend(lm_head)
        and getattr(processor, "rl_on_policy_target", None) is None
        and hidden.dtype == weight.dtype
    )


def computing(
    original: Callable,
    pack: Callable[[torch.nn.Module], None],
    packed_linear: Callable[..., torch.Tensor | None],
) -> Callable:
    """``_compute_lm_head`` through the packed head where upstream would use ``torch.matmul``;
    ``pack`` and ``packed_linear`` are ``cpu_packed_linear``'s (passed in: it imports this)."""

    @functools.wraps(original)
    def _compute_lm_head(self, hidden_states, lm_head, embedding_bias=None, *, out=None):
        if plain_head(self, lm_head, hidden_states):
            if not hasattr(lm_head, "_sgl_spec_packed"):
                lm_head._sgl_spec_packed = None  # not packable: asked once
                pack(lm_head)
            logits = packed_linear(lm_head, hidden_states, None)
            if logits is not None:
                return logits
        return original(self, hidden_states, lm_head, embedding_bias, out=out)

    _compute_lm_head._sgl_spec_packed_lm_head = True  # type: ignore[attr-defined]
    return _compute_lm_head


def apply(
    pack: Callable[[torch.nn.Module], None], packed_linear: Callable[..., torch.Tensor | None]
) -> None:
    """Wrap the method (idempotent); ``cpu_packed_linear.apply`` calls this once its kernel is
    known to be there."""
    cls = _module().LogitsProcessor
    if not getattr(cls._compute_lm_head, "_sgl_spec_packed_lm_head", False):
        cls._compute_lm_head = computing(cls._compute_lm_head, pack, packed_linear)
