"""The speculative algorithms sgl-spec adds to SGLang: one package each, one line here.

A package holds ``algorithm.py`` (``ALGORITHM``, an ``sgl_spec.common.algorithm.Algorithm``) and
``flags.py`` (``FLAGS``, the frozen dataclass of its command-line flags, from which
``sgl_spec.config.SpecConfig`` is assembled). Leaf module: the config and the launcher read it.
"""

from __future__ import annotations

PACKAGES = (
    "sgl_spec.mtp",
    "sgl_spec.specblock",
    "sgl_spec.minedraft",
)
