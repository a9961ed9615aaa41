"""Interpreter start-up hook that lets the published ``sgl_kernel`` import on a CPU-only host.

The published ``sglang-kernel`` wheel carries the Python wrappers of every CPU op
(``sgl_kernel.speculative.verify_tree_greedy_cpu``, ``sgl_kernel.kvcacheio``, ...) but only
a CUDA build of the compiled library; ``sgl_kernel/__init__`` dies in
``load_utils._load_architecture_specific_ops`` with ``libcuda.so.1`` missing. SGLang's CPU
engine imports ``sgl_kernel`` at module import time in every process it spawns, before any
plugin runs, so the fix has to be installed at interpreter start-up: a ``.pth`` file in
site-packages imports this module, which adds one meta-path finder. The finder touches only
``sgl_kernel.load_utils``; when the real library loads nothing changes. When it cannot load,
our PyTorch implementations of the CPU ops, and of the few ops SGLang's CUDA path may call
(``cuda_ops.py``), are registered under ``torch.ops.sgl_kernel`` and the import proceeds.

SGLang enables its CPU kernel paths (and keeps ``--attention-backend intel_amx``, the only CPU
backend with speculative decoding) only where ``cpu_has_amx_support()`` holds: AMX tiles *and*
the kernel library. Our ops are plain PyTorch and need no AMX, so while they stand in for the
library, the same finder makes ``sglang.srt.utils.common.cpu_has_amx_support`` answer "the
kernels are here" on CPUs without AMX too (e.g. AMD EPYC); without that SGLang falls back to
``torch_native`` and every speculative algorithm fails on such hosts.

This module must stay cheap: it runs in every Python process of the venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

_LOAD_UTILS = "sgl_kernel.load_utils"
_SGLANG_COMMON = "sglang.srt.utils.common"
ENV_DISABLE = "SGLSPEC_CPU_KERNELS"
_state = {"fallback": False}


def fallback_active() -> bool:
    """True once our PyTorch ops were registered in place of the ``sgl_kernel`` library."""
    return _state["fallback"]


def fallback_allowed() -> bool:
    """True when our PyTorch ops may stand in for a ``sgl_kernel`` library that cannot load.

    On a CUDA host too (e.g. the published sglang-kernel, built against another torch): SGLang
    then serves with the launcher's torch-native settings (``launch_server``) and our ops
    answer whatever ``sgl_kernel`` op still gets called. ``SGLSPEC_CPU_KERNELS=0`` turns the
    fallback off, so the library's own import error surfaces.
    """
    return os.environ.get(ENV_DISABLE, "1").lower() not in ("0", "false", "off")


def _patch_load_utils(module: types.ModuleType) -> None:
    original_load = module._load_architecture_specific_ops
    original_preload = module._preload_cuda_library

    def load_ops() -> object:
        try:
            return original_load()
        except ImportError:
            if not fallback_allowed():
                raise
            from sgl_spec.cpu_kernels import register_all

            register_all()
            _state["fallback"] = True
            return types.SimpleNamespace(__name__="sgl_spec.cpu_kernels", fallback=True)

    def preload_cuda() -> None:
        if _state["fallback"]:
            return
        original_preload()

    module._load_architecture_specific_ops = load_ops
    module._preload_cuda_library = preload_cuda


def _patch_sglang_common(module: types.ModuleType) -> None:
    original = module.cpu_has_amx_support
    kernels_available = module._is_intel_amx_backend_available

    def cpu_has_amx_support() -> bool:
        # kernels_available() imports sgl_kernel, which is what registers the fallback. A CUDA
        # host never takes SGLang's CPU kernel paths, so it never gets the answer "yes".
        if bool(original()):
            return True
        import torch

        return bool(kernels_available()) and fallback_active() and not torch.cuda.is_available()

    module.cpu_has_amx_support = cpu_has_amx_support


_PATCHES = {_LOAD_UTILS: _patch_load_utils, _SGLANG_COMMON: _patch_sglang_common}


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class SglKernelFinder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the two modules in ``_PATCHES``; every other import is left alone."""

    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _WrappingLoader(spec.loader, patch)
        return spec


def install() -> None:
    """Add the finder once per process (idempotent)."""
    if any(isinstance(f, SglKernelFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SglKernelFinder())


install()
