"""SGLang plugin entry point (group ``sglang.srt.plugins``).

SGLang calls ``register()`` in the launcher, the engine and every scheduler process. It
registers our speculative algorithms (``sgl_spec/algorithms.py``) and applies the upstream
patches in ``patches/``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sgl_spec.algorithms import register_all
    from sgl_spec.config import process_config
    from sgl_spec.patches import apply_patches

    config = process_config()
    apply_patches(config)
    register_all(config)
