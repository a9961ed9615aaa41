"""Patch: SGLang's CPU graph runner compiles without dynamo's guards on module attributes.

Upstream target: ``sglang.srt.model_executor.cpu_graph_runner.patch_model`` (SGLang 0.5.23).
With ``--enable-torch-compile`` on CPU the runner compiles ``model.forward`` with dynamo's
default guards, and every forward re-checks all of them before it runs the graph: for a Llama,
hundreds a layer, most on ``nn.Module`` attributes (hook dicts, flags, submodule identities).
On the 2-vCPU host that check cost ~10% of the shipped target's decode and ~17% of the draft
model's (``benchmarks/compiled_forward.py``). A served model's modules do not change after the
runner captured it (the runner refuses LoRA, and the compiled graph holds the weights as frozen
constants anyway), so the patched ``patch_model`` compiles with torch's
``skip_guard_on_all_nn_modules_unsafe`` guard filter; the guards on the inputs (shapes, dtypes,
the batch's constant fields) stay. It relies on one compiled model per process, as the runner
has: dynamo keeps its compiled graphs per code object, and without module guards a second
model of the same class would be served the first one's graph.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator

import torch

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.model_executor.cpu_graph_runner"


def enabled(config: SpecConfig) -> bool:
    return True  # only --enable-torch-compile on a CPU host reaches the patched function


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    module = importlib.import_module(TARGET)
    patch_model = getattr(module, "patch_model", None)
    if patch_model is None:
        raise RuntimeError(f"{TARGET}.patch_model is gone: patch needs updating")
    params = list(inspect.signature(patch_model).parameters)
    if params != ["model", "enable_compile", "num_tokens", "tp_group"]:
        raise RuntimeError(f"{TARGET}.patch_model params changed: {params}")
    source = inspect.getsource(patch_model)
    if "torch.no_grad()(model.forward)" not in source or "dynamic=False" not in source:
        raise RuntimeError(f"{TARGET}.patch_model no longer compiles model.forward as expected")
    if not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        raise RuntimeError("torch.compiler.skip_guard_on_all_nn_modules_unsafe is gone")


def apply() -> bool:
    module = importlib.import_module(TARGET)
    if getattr(module.patch_model, "_sgl_spec_patched", False):
        return False

    @contextlib.contextmanager
    def patch_model(
        model: torch.nn.Module, enable_compile: bool, num_tokens: int, tp_group: object
    ) -> Iterator:
        if not enable_compile:
            yield model.forward
            return
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        yield torch.compile(torch.no_grad()(model.forward), dynamic=False, options=options)

    patch_model._sgl_spec_patched = True  # type: ignore[attr-defined]
    module.patch_model = patch_model
    return True
