"""Fault injection for end-to-end tests (``tests/e2e/test_faults.py``), in every process of a
server started with this folder on ``PYTHONPATH``: Python imports ``sitecustomize`` at start-up,
in the launcher and in each process SGLang spawns, so a fault can be planted in the scheduler
without a test-only code path in ``sgl_spec``.

``SGLSPEC_FAULT_ADAPT_FAILURES=N``: the first N SPECBLOCK adaptation updates
(``DrafterCopies.update``) raise after their first optimizer step, i.e. mid-update, with
``theta_train`` already changed. The patch is applied when ``sgl_spec.specblock.adapt.update``
is imported.

``SGLSPEC_FAULT_CONTROLLER_FILE=PATH``: once PATH exists, the next
``SpeculationController.decide`` raises (once per process): the controller failing mid-serving.

Nothing else is touched, and without the variables this file does nothing.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

NUM_FAILURES = int(os.environ.get("SGLSPEC_FAULT_ADAPT_FAILURES", "0") or 0)
CONTROLLER_FILE = os.environ.get("SGLSPEC_FAULT_CONTROLLER_FILE", "")


def _patch_adapt(module) -> None:
    real_update, real_loss = module.DrafterCopies.update, module.adapt_loss
    failed = [0]

    def update(self, action, examples, stream=None):
        if failed[0] >= NUM_FAILURES:
            return real_update(self, action, examples, stream)
        failed[0] += 1
        steps = [0]

        def loss_then_fault(*args, **kwargs):
            steps[0] += 1
            if steps[0] > 1 or self.cfg.steps_per_update == 1:
                raise RuntimeError(f"injected fault: adaptation update {failed[0]} fails")
            return real_loss(*args, **kwargs)

        module.adapt_loss = loss_then_fault
        try:
            return real_update(self, action, examples, stream)
        finally:
            module.adapt_loss = real_loss

    module.DrafterCopies.update = update


def _patch_controller(module) -> None:
    real_decide = module.SpeculationController.decide
    fired = [False]

    def decide(self, batch_size, ctx_len):
        if not fired[0] and os.path.exists(CONTROLLER_FILE):
            fired[0] = True
            raise RuntimeError("injected fault: the controller's decide raises")
        return real_decide(self, batch_size, ctx_len)

    module.SpeculationController.decide = decide


PATCHES = {}
if NUM_FAILURES > 0:
    PATCHES["sgl_spec.specblock.adapt.update"] = _patch_adapt
if CONTROLLER_FILE:
    PATCHES["sgl_spec.control.controller"] = _patch_controller


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            find = None if finder is self else getattr(finder, "find_spec", None)
            spec = None if find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if PATCHES:
    sys.meta_path.insert(0, _PatchOnImport())
