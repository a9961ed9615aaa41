"""Patch: let SGLang's CPU graph runner (``--enable-torch-compile`` on CPU) start with our ops.

Upstream target: ``sglang.srt.model_executor.cpu_graph_runner.register_cpu_compile_fake``
(SGLang 0.5.23). At start-up the runner registers a fake (meta) implementation for every op of
a CPU build of ``sgl_kernel`` it knows, and ``torch.library.register_fake`` raises for an op
that is not defined: where our PyTorch ops stand in for the compiled library
(``sgl_spec.cpu_kernels``), the ops we do not provide (``shm_allreduce``, the MoE and
quantised kernels) do not exist, and the server dies before it serves. The patched function
returns a decorator that registers nothing for an op that is not defined; ops that are defined
get their fake as upstream, except where our op returns another layout than upstream's kernel
(``OWN_FAKES``): a fake must describe the kernel that runs, or the compiled graph's layout
checks stop it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

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


def _rotary_embedding_fake(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # ours returns new contiguous tensors; upstream's rotates a 2-d pair in place and
    # returns the (row-strided) inputs, which is what its fake says
    return query.new_empty(query.shape), key.new_empty(key.shape)


OWN_FAKES: dict[str, Callable] = {"rotary_embedding_cpu": _rotary_embedding_fake}


def apply() -> bool:
    from sgl_spec.cpu_kernels.registry import op_defined

    module = importlib.import_module(TARGET)
    upstream = module.register_cpu_compile_fake
    if getattr(upstream, "_sgl_spec_patched", False):
        return False

    def register_cpu_compile_fake(op_name: str) -> Callable[[Callable], Callable]:
        if not op_defined(op_name):
            return lambda fn: fn
        register = upstream(op_name)
        own = OWN_FAKES.get(op_name)
        if own is None:
            return register

        def register_own(fn: Callable) -> Callable:
            register(own)
            return fn

        return register_own

    register_cpu_compile_fake._sgl_spec_patched = True  # type: ignore[attr-defined]
    module.register_cpu_compile_fake = register_cpu_compile_fake
    return True
