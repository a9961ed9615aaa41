"""Patch: with ``--enable-torch-compile`` on CPU, our algorithms' target runners start without
SGLang's CPU graph runner, and compile their own forwards.

Upstream target: ``sglang.srt.model_executor.model_runner_components.cuda_graph_setup.
capture_decode_graph`` (SGLang 0.5.23). On a CPU host with ``--enable-torch-compile`` it builds
a ``CPUGraphRunner`` for the target's model runner, which asserts a non-speculative server: a
launch of any of ours with the flag died at start-up. The patched function returns no decode
runner for the target of one of ours (as upstream does for a CPU host without the flag); the
algorithm then compiles the forwards it runs itself (``sgl_spec/common/compiled_forwards.py``:
verifies of its chain widths, the draft model's decode, a plain decode step), which SGLang's
runner does not capture. SGLang's own speculative algorithms and a non-speculative server get
upstream's function.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup"
NAME = "capture_decode_graph"


def enabled(config: SpecConfig) -> bool:
    return True  # only a CPU runner with --enable-torch-compile of one of ours is affected


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    module = importlib.import_module(TARGET)
    function = getattr(module, NAME, None)
    if function is None or getattr(module, "GraphCapture", None) is None:
        raise RuntimeError(f"{TARGET}.{NAME} or GraphCapture is gone: patch needs updating")
    params = list(inspect.signature(function).parameters)
    if params != ["model_runner"]:
        raise RuntimeError(f"{TARGET}.{NAME} params changed: {params}")
    source = inspect.getsource(module.capture_cuda_graphs)
    if f"{NAME}(model_runner=model_runner)" not in source:
        raise RuntimeError(f"{TARGET}.capture_cuda_graphs no longer calls {NAME} by name")


def ours(model_runner: Any) -> bool:
    """Whether ``model_runner`` serves one of our algorithms: registered under its name, or
    served as SGLang's (``Algorithm.runs_as``) where the launch asked for ours."""
    from sgl_spec.algorithms import all_algorithms, find
    from sgl_spec.config import process_config

    algorithm = model_runner.spec_algorithm
    if algorithm is None or algorithm.is_none():
        return False
    if find(algorithm.name) is not None:
        return True
    config = process_config()
    return any(a.runs_as == algorithm.name and a.marked(config) for a in all_algorithms())


def apply() -> bool:
    module = importlib.import_module(TARGET)
    upstream = getattr(module, NAME)
    if getattr(upstream, "_sgl_spec_patched", False):
        return False

    def capture_decode_graph(*, model_runner: Any) -> Any:
        from sgl_spec.common.compiled_forwards import compile_requested

        if compile_requested(model_runner) and ours(model_runner):
            phase = "draft_decode" if model_runner.is_draft_worker else "target_verify"
            return module.GraphCapture(
                runner=None, memory_phase=phase, memory_usage_gb=0, capture_time=0
            )
        return upstream(model_runner=model_runner)

    capture_decode_graph._sgl_spec_patched = True  # type: ignore[attr-defined]
    setattr(module, NAME, capture_decode_graph)
    return True
