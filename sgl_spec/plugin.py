"""SGLang plugin entry point (group ``sglang.srt.plugins``).

SGLang calls ``register()`` in the launcher, the engine and every scheduler process. It
registers our speculative algorithms and applies the upstream patches in ``patches/``.
Registered: MTP_LORA (``sgl_spec/mtp/``), SPECBLOCK (``sgl_spec/specblock/``), MINEDRAFT
(``sgl_spec/minedraft/``).
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
    from sgl_spec.config import SpecConfig
    from sgl_spec.minedraft import algorithm as minedraft_algorithm
    from sgl_spec.mtp import algorithm as mtp_algorithm
    from sgl_spec.patches import apply_patches
    from sgl_spec.specblock import algorithm as specblock_algorithm

    config = SpecConfig.from_env()
    apply_patches(config)
    mtp_algorithm.register()
    specblock_algorithm.register()
    minedraft_algorithm.register()
