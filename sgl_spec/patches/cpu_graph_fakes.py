"""Patch: let SGLang's CPU graph runner (``--enable-torch-compile`` on CPU) start with our ops.

Upstream target: ``sglang.srt.model_executor.cpu_graph_runner.register_cpu_compile_fake``
(SGLang 0.5.23). At start-up the runner registers a fake (meta) implementation for every op of
a CPU build of ``sgl_kernel`` it knows, and ``torch.library.register_fake`` raises for an op
that is not defined: where our PyTorch ops stand in for the compiled library
(``sgl_spec.cpu_kernels``), the ops we do not provide (``shm_allreduce``, the MoE and
quantised kernels) do not exist, and the server dies before it serves. The patched function
returns a decorator that registers nothing for an op that is not defined; ops that are defined
get their fake exactly as upstream.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.model_executor.cpu_graph_runner"


def enabled(config: SpecConfig) -> bool:
    return True  # without it --enable-torch-compile cannot start on CPU with our ops


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    module = importlib.import_module(TARGET)
    if not callable(getattr(module, "register_cpu_compile_fake", None)):
        raise RuntimeError(f"{TARGET}.register_cpu_compile_fake is gone: patch needs updating")
    if not isinstance(getattr(module, "_CPU_COMPILE_FAKE_OPS", None), set):
        raise RuntimeError(f"{TARGET}._CPU_COMPILE_FAKE_OPS is gone: patch needs updating")


def apply() -> bool:
    from sgl_spec.cpu_kernels.registry import op_defined

    module = importlib.import_module(TARGET)
    upstream = module.register_cpu_compile_fake
    if getattr(upstream, "_sgl_spec_patched", False):
        return False

    def register_cpu_compile_fake(op_name: str) -> Callable[[Callable], Callable]:
        if op_defined(op_name):
            return upstream(op_name)
        return lambda fn: fn

    register_cpu_compile_fake._sgl_spec_patched = True  # type: ignore[attr-defined]
    module.register_cpu_compile_fake = register_cpu_compile_fake
    return True
