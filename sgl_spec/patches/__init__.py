"""Upstream behaviour changes that subclassing and the registration API cannot express.

One module per upstream target; each names the SGLang function it changes in ``TARGET``,
says whether our config wants it (``enabled(config)``), checks that the pinned SGLang still has
the shape it expects (``check()``) and applies itself (``apply()``). ``tests/test_patches.py`` runs every ``check()`` so an upstream change fails
loudly instead of silently disabling a fix.
"""

from __future__ import annotations

import logging

from sgl_spec.config import SpecConfig

logger = logging.getLogger(__name__)


# Every patch module, in the order they are applied.
PATCHES = (
    "cpu_graph_fakes",
    "cpu_spec_sampling",
    "cuda_optional_kernels",
    "prompt_validation",
    "specblock_kv_budget",
    "standalone_full_context",
)


def all_patches() -> list:
    import importlib

    return [importlib.import_module(f"sgl_spec.patches.{name}") for name in PATCHES]


def apply_patches(config: SpecConfig) -> list[str]:
    applied: list[str] = []
    for patch in all_patches():
        if patch.enabled(config) and patch.apply():
            applied.append(patch.__name__.rsplit(".", 1)[-1])
    if applied:
        logger.info("sgl_spec: applied patches %s", ", ".join(applied))
    return applied
