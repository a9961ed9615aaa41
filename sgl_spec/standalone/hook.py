"""Patch: SGLang builds STANDALONE_FULL's draft worker (``draft.FullContextDraftWorker``, our
subclass of its ``StandaloneDraftWorker``) in place of its own.

Installed through SGLang's plugin hook registry (a class ``REPLACE``), so every module that
names the upstream class, ``StandaloneWorkerV2``'s constructor included, builds ours; the
upstream class itself is not modified. Only in a launch that asked for STANDALONE_FULL (the
launcher records it in our config, which every process reads): ``--speculative-algorithm
STANDALONE`` keeps SGLang's own worker. ``check()`` refuses an SGLang whose draft worker no
longer has the methods the subclass replaces, with the parameters it was written against.
"""

from __future__ import annotations

import importlib
import inspect

from sgl_spec.config import SpecConfig, process_config

TARGET = "sglang.srt.speculative.standalone_worker_v2"
CLASS = "StandaloneDraftWorker"
# With --standalone-steps other than fixed, SGLang's worker is replaced too (control.py).
WORKER_CLASS = "StandaloneWorkerV2"


def enabled(config: SpecConfig) -> bool:
    return config.standalone_full_context


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape the subclass expects."""
    from sglang.srt.speculative import eagle_worker_common

    from sgl_spec.standalone.draft import REPLACED

    cls = getattr(importlib.import_module(TARGET), CLASS, None)
    if cls is None:
        raise RuntimeError(f"{TARGET} lacks {CLASS}: the subclass needs updating")
    for name, expected in REPLACED.items():
        params = set(inspect.signature(getattr(cls, name)).parameters)
        if params != expected:
            raise RuntimeError(f"{TARGET}.{CLASS}.{name} params: {sorted(params)}")
    for name in ("prepare_for_draft", "prepare_for_draft_extend", "build_eagle_verify_input"):
        if not hasattr(eagle_worker_common, name):
            raise RuntimeError(f"eagle_worker_common lacks {name}: the subclass needs updating")
    worker = getattr(importlib.import_module(TARGET), WORKER_CLASS, None)
    adaptive = ("build_adaptive_runtime_state", "apply_runtime_state", "activate_step_by_batch",
                "on_verify_complete_cpu", "_override_worker_state")  # fmt: skip
    missing = [name for name in adaptive if not hasattr(worker, name)]
    if missing:  # --standalone-steps drives SGLang's adaptive step switching (control.py)
        raise RuntimeError(f"{TARGET}.{WORKER_CLASS} lacks {', '.join(missing)}")


def apply() -> bool:
    """Register the class replacements with SGLang's hook registry and apply them now (SGLang
    applies registered hooks after its plugins ran; applying is idempotent)."""
    from sgl_spec.standalone.draft import FullContextDraftWorker

    module = importlib.import_module(TARGET)
    _replace(module, CLASS, FullContextDraftWorker)
    if process_config().standalone_steps not in (None, "fixed"):
        from sgl_spec.standalone.control import ControlledStandaloneWorker

        _replace(module, WORKER_CLASS, ControlledStandaloneWorker)
    return True


def _replace(module: object, name: str, cls: type) -> None:
    """``module.name`` becomes ``cls`` through SGLang's hook registry (a class ``REPLACE``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if getattr(module, name) is not cls:
        HookRegistry.register(f"{TARGET}.{name}", cls, HookType.REPLACE)
        HookRegistry.apply_hooks()
    if getattr(module, name) is not cls:
        raise RuntimeError(f"SGLang's hook registry did not replace {TARGET}.{name}")
