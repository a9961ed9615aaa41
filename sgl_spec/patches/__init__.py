"""Upstream behaviour changes that subclassing and the registration API cannot express.

One module per upstream target; each names the SGLang function it changes in ``TARGET``,
checks that the pinned SGLang still has the shape it expects (``check()``) and applies itself
(``apply()``). ``tests/test_patches.py`` runs every ``check()`` so an upstream change fails
loudly instead of silently disabling a fix.
"""

from __future__ import annotations

import logging

from sgl_spec.config import SpecConfig

logger = logging.getLogger(__name__)


def all_patches() -> list:
    from sgl_spec.patches import cpu_spec_sampling

    return [cpu_spec_sampling]


def apply_patches(config: SpecConfig) -> list[str]:
    applied: list[str] = []
    for patch in all_patches():
        name = patch.__name__.rsplit(".", 1)[-1]
        if name == "cpu_spec_sampling" and not config.cpu_lossless_sampling:
            continue
        if patch.apply():
            applied.append(name)
    if applied:
        logger.info("sgl_spec: applied patches %s", ", ".join(applied))
    return applied
