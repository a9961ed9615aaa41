"""Patch: tensor parallelism on the CPU engine builds no NCCL communicator.

Upstream target (SGLang 0.5.23): ``sglang.srt.distributed.parallel_state.
init_model_parallel_group`` asks for a PyNccl communicator (``use_pynccl``) in every group
of every in-tree platform except NPU and XPU. On the CPU engine the groups' backend is gloo
and the device is the CPU, yet where PyTorch's CUDA build brings ``libnccl`` (a CUDA wheel of
torch on a host without a GPU) the communicator loads and stops every rank at start with
"Expected a cuda device, but got: cpu"; only where no NCCL library loads does it disable itself.
Patched, a gloo group asks for none unless the caller asked explicitly: the collectives run
through gloo (or ``sgl_kernel``'s shared-memory ops) as they do on a CPU-only install.

Nothing changes for NCCL, or any other backend, groups.
"""

from __future__ import annotations

import functools
import importlib
import inspect

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.distributed.parallel_state"
_MARK = "_sgl_spec_cpu_tensor_parallel"


def enabled(config: SpecConfig) -> bool:
    return True  # a start-up fix for gloo groups; NCCL groups are untouched


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    module = importlib.import_module(TARGET)
    func = getattr(module, "init_model_parallel_group", None)
    if func is None:
        raise RuntimeError(f"{TARGET}.init_model_parallel_group is gone: patch needs updating")
    params = list(inspect.signature(inspect.unwrap(func)).parameters)
    if params[:4] != ["group_ranks", "local_rank", "backend", "use_pynccl"]:
        raise RuntimeError(f"{TARGET}.init_model_parallel_group takes {params[:4]}")


def apply() -> bool:
    module = importlib.import_module(TARGET)
    original = module.init_model_parallel_group
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def init_model_parallel_group(group_ranks, local_rank, backend, *args, **kwargs):
        if backend == "gloo" and not args and kwargs.get("use_pynccl") is None:
            kwargs["use_pynccl"] = False
        return original(group_ranks, local_rank, backend, *args, **kwargs)

    setattr(init_model_parallel_group, _MARK, True)
    module.init_model_parallel_group = init_model_parallel_group
    return True
