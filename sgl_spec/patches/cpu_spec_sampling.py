"""Patch: lossless sampling in SGLang's EAGLE/STANDALONE verify on CPU hosts.

Upstream target: ``sglang.srt.speculative.eagle_utils`` (SGLang 0.5.23).
``_verify_uses_greedy`` returns True whenever ``is_cpu``, so on CPU a speculative server commits
the target's *argmax* even for requests with temperature > 0 — its outputs are not samples of
the target distribution (``tests/e2e/test_lossless_standalone.py`` shows it with this patch off). The
reason is only that no CPU kernel exists for ``tree_speculative_sampling_target_only`` and the
top-k/top-p renormalisation (all three are ``None`` on CPU). This patch supplies PyTorch versions
(``sgl_spec.verify.tree_sampling``) and lets CPU take the sampling branch. GPUs are untouched.
"""

from __future__ import annotations

import inspect
from types import ModuleType

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.speculative.eagle_utils"
_NAMES = (
    "_verify_uses_greedy",
    "tree_speculative_sampling_target_only",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
    "_is_cpu",
)


def enabled(config: SpecConfig) -> bool:
    return config.cpu_lossless_sampling


def _module() -> ModuleType:
    import importlib

    return importlib.import_module(TARGET)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    mod = _module()
    missing = [n for n in _NAMES if not hasattr(mod, n)]
    if missing:
        raise RuntimeError(f"{TARGET} lacks {missing}: patch cpu_spec_sampling needs updating")
    params = set(inspect.signature(mod._verify_uses_greedy).parameters)
    expected = {"is_all_greedy", "is_cpu", "is_hip", "is_xpu", "use_rejection_sampling"}
    if params != expected:
        raise RuntimeError(f"{TARGET}._verify_uses_greedy params changed: {sorted(params)}")


def apply() -> bool:
    """Install the CPU sampling path; returns False (and changes nothing) off CPU."""
    check()
    mod = _module()
    if not mod._is_cpu:
        return False
    from sgl_spec.verify import tree_sampling

    original = mod._verify_uses_greedy

    def verify_uses_greedy(**kwargs: bool) -> bool:
        return original(**{**kwargs, "is_cpu": False})

    verify_uses_greedy.__wrapped__ = original  # type: ignore[attr-defined]
    mod._verify_uses_greedy = verify_uses_greedy
    if mod.tree_speculative_sampling_target_only is None:
        mod.tree_speculative_sampling_target_only = (
            tree_sampling.tree_speculative_sampling_target_only
        )
    if mod.top_k_renorm_prob is None:
        mod.top_k_renorm_prob = tree_sampling.top_k_renorm_prob
    if mod.top_p_renorm_prob is None:
        mod.top_p_renorm_prob = tree_sampling.top_p_renorm_prob
    return True
