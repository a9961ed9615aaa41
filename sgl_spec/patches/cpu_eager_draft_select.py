"""Patch: the EAGLE-style draft loop selects its later tokens eagerly on the CPU.

Upstream target: ``sglang.srt.speculative.spec_utils._select_top_k_tokens_later`` (SGLang
0.5.23), the selection after draft step 1 of EAGLE / STANDALONE drafting (STANDALONE_FULL's
too). Upstream wraps it in ``torch.compile(dynamic=True)`` on every device but NPU and XPU; on
the CPU the first call compiles it through inductor's C++ backend, in the middle of serving: a
served STANDALONE_FULL request stalled 12 s at the first step that drafted two tokens
(``benchmarks/RESULTS.md``, 2026-12-04), seconds with a warm compile cache. The function moves
a few ``[batch, topk]`` entries, where compiled code saves nothing. The patched name calls
the function ``torch.compile`` wrapped (the same code, eager) for CPU tensors and the compiled
one elsewhere; ``select_top_k_tokens`` looks the name up at call time, so rebinding it is
enough.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.speculative.spec_utils"
NAME = "_select_top_k_tokens_later"


def enabled(config: SpecConfig) -> bool:
    return True  # CPU tensors only; the compiled function serves every other device


def _eager(compiled: Callable) -> Callable | None:
    return getattr(compiled, "_torchdynamo_orig_callable", None)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    module = importlib.import_module(TARGET)
    function = getattr(module, NAME, None)
    if function is None or not callable(getattr(module, "select_top_k_tokens", None)):
        raise RuntimeError(f"{TARGET}.{NAME} or select_top_k_tokens is gone: patch needs updating")


def apply() -> bool:
    """Rebind the name; nothing to do where upstream left it eager (``torch.compile`` disabled
    on this platform, or no longer wrapped)."""
    module = importlib.import_module(TARGET)
    compiled = getattr(module, NAME)
    if getattr(compiled, "_sgl_spec_patched", False):
        return False
    eager = _eager(compiled)
    if eager is None:
        return False

    def _select_top_k_tokens_later(i, topk_p, topk_index, hidden_states, scores, topk):
        chosen = eager if topk_p.device.type == "cpu" else compiled
        return chosen(i, topk_p, topk_index, hidden_states, scores, topk)

    _select_top_k_tokens_later._sgl_spec_patched = True  # type: ignore[attr-defined]
    setattr(module, NAME, _select_top_k_tokens_later)
    return True
