"""The speculative algorithms sgl-spec adds to SGLang: one package each, one line here.

A package holds ``algorithm.py`` (``ALGORITHM``, an ``sgl_spec.common.algorithm.Algorithm``) and
``flags.py`` (``FLAGS``, the frozen dataclass of its command-line flags, from which
``sgl_spec.config.SpecConfig`` is assembled). Leaf module: the config and the launcher read it.

An algorithm kept outside this package (an experiment, the test suite's toy algorithm) is
added by naming its importable package in ``SGLSPEC_EXTRA_ALGORITHMS`` (comma-separated), in
the launcher's environment: every process SGLang spawns inherits it, so all of them assemble
the same config and register the same algorithms.
"""

from __future__ import annotations

import os

PACKAGES = (
    "sgl_spec.standalone",
    "sgl_spec.mtp",
    "sgl_spec.specblock",
    "sgl_spec.minedraft",
)

# What the launcher serves with no --model-path: the shipped target and draft with this one.
DEFAULT = "STANDALONE_FULL"
EXTRA_ENV = "SGLSPEC_EXTRA_ALGORITHMS"


def packages() -> tuple[str, ...]:
    """``PACKAGES``, then those named in ``SGLSPEC_EXTRA_ALGORITHMS``."""
    extra = os.environ.get(EXTRA_ENV, "")
    return (*PACKAGES, *(p.strip() for p in extra.split(",") if p.strip()))
