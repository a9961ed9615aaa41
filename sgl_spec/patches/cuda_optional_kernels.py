"""Patch: serve on a CUDA host that lacks SGLang's optional kernel packages.

Upstream targets (SGLang 0.5.23):
- ``sglang.srt.layers.dual_gemm.DualGemm._select_mode`` imports the CuTe-DSL dual-GEMM module
  (``import cutlass``, package nvidia-cutlass-dsl) for every dense MLP on CUDA, before it looks
  at the dtype: without that package no Llama/Qwen model loads. Where ``cutlass`` is absent the
  patched method answers "no dual GEMM", the path SGLang takes for any layer the kernel cannot
  serve (separate gate/up GEMM + activation).
- ``sglang.srt.speculative.eagle_utils``: the sampled (temperature > 0) verify of
  STANDALONE/EAGLE calls ``tree_speculative_sampling_target_only`` and the top-k/top-p
  renormalisation, which build on flashinfer on CUDA. Where flashinfer is absent they are
  replaced by the PyTorch versions the CPU path uses (``sgl_spec.verify.tree_sampling``: the
  same rejection-sampling law, host-side tree walk).
- ``sglang.srt.layers.attention.flashmla_backend`` imports the ``flash_mla`` package at module
  level, and EAGLE's draft CUDA-graph capture (``eagle_worker_v2._capture_cuda_graphs``) imports
  it only to ask whether the draft's attention backend is a ``FlashMLABackend``. Where
  ``flash_mla`` is absent that module is replaced by one whose ``FlashMLABackend`` nothing is an
  instance of, so the answer is "no" (true: no backend of that class can exist without the
  package) instead of an import error that stops every STANDALONE/EAGLE server with graphs.

Nothing changes where the packages are installed, or on a host without CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from sgl_spec.config import SpecConfig

DUAL_GEMM = "sglang.srt.layers.dual_gemm"
EAGLE_UTILS = "sglang.srt.speculative.eagle_utils"
FLASHMLA_BACKEND = "sglang.srt.layers.attention.flashmla_backend"
TARGET = (DUAL_GEMM, EAGLE_UTILS)
_SAMPLING_NAMES = (
    "tree_speculative_sampling_target_only",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
)


def enabled(config: SpecConfig) -> bool:
    return True  # a crash fix where the packages are missing, a no-op where they are present


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    dual = _module(DUAL_GEMM)
    if not callable(getattr(getattr(dual, "DualGemm", None), "_select_mode", None)):
        raise RuntimeError(f"{DUAL_GEMM}.DualGemm._select_mode is gone: patch needs updating")
    eagle = _module(EAGLE_UTILS)
    missing = [n for n in _SAMPLING_NAMES if not hasattr(eagle, n)]
    if missing:
        raise RuntimeError(
            f"{EAGLE_UTILS} lacks {missing}: patch cuda_optional_kernels needs updating"
        )


def missing_packages() -> list[str]:
    """The optional kernel packages this patch stands in for that are not installed."""
    names = ("cutlass", "flashinfer", "flash_mla")
    return [name for name in names if importlib.util.find_spec(name) is None]


def apply(cuda: bool | None = None, missing: list[str] | None = None) -> bool:
    """Install the fallbacks for the missing packages on a CUDA host; False when nothing to do.
    ``cuda`` / ``missing`` default to this host's answers (tests pass them)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    missing = missing_packages() if missing is None else missing
    if not cuda or not missing:
        return False
    check()
    if "cutlass" in missing:
        dual_gemm = _module(DUAL_GEMM).DualGemm

        def select_mode(self, gate_up_proj, hidden_size):
            return None

        select_mode.__wrapped__ = dual_gemm._select_mode  # type: ignore[attr-defined]
        dual_gemm._select_mode = select_mode
    if "flashinfer" in missing:
        from sgl_spec.verify import tree_sampling

        eagle = _module(EAGLE_UTILS)
        for name in _SAMPLING_NAMES:
            setattr(eagle, name, getattr(tree_sampling, name))
    if "flash_mla" in missing:
        _stand_in_flashmla_backend()
    return True


class FlashMLABackendUnavailable:
    """``FlashMLABackend`` where the ``flash_mla`` package is missing: never instantiated."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise ImportError("the flash_mla package is not installed: no FlashMLA attention backend")


def _stand_in_flashmla_backend() -> None:
    """Put a module holding only ``FlashMLABackendUnavailable`` (as ``FlashMLABackend``) where
    ``flashmla_backend`` cannot import; any other name asked of it raises ImportError."""
    import sys

    try:
        importlib.import_module(FLASHMLA_BACKEND)
        return
    except ModuleNotFoundError as exc:
        if exc.name != "flash_mla":
            raise
    module = ModuleType(FLASHMLA_BACKEND, "stand-in: the flash_mla package is not installed")
    module.FlashMLABackend = FlashMLABackendUnavailable  # type: ignore[attr-defined]
    sys.modules[FLASHMLA_BACKEND] = module
