"""Patch: SGLang's KV budget counts the SPECBLOCK drafter's KV cache.

Upstream target: ``sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator``
(SGLang 0.5.23). SGLang sizes the target's KV pool from free device memory and the per-token
cost of the target's layers (plus EAGLE/STANDALONE/DFLASH draft layers, which it knows). The
SPECBLOCK worker keeps one drafter KV row (K positions x drafter layers) per target KV location,
allocated after the target pool; uncounted, a drafter with 2 layers and K = 4 doubles the KV
memory of an 8-layer target and the server is killed for memory at start-up. This patch adds
the drafter's bytes per location to the per-token cell size, so the two pools together fit the
budget SGLang would have given the target alone. ``--max-total-tokens`` still wins (SGLang then
skips the budget), as it does for SGLang's own draft pools.

MINEDRAFT hosting a SpecBlock drafter (``--minedraft-drafter specblock``) keeps one row of the
target's (low, mid, top) features per target KV location instead (``TargetFeatureCache`` in
``minedraft/feature_cache.py``); those bytes are counted the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.model_executor.pool_configurator"
logger = logging.getLogger(__name__)


def enabled(config: SpecConfig) -> bool:
    return config.specblock_drafter_path is not None


def _module() -> ModuleType:
    import importlib

    return importlib.import_module(TARGET)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    cls = getattr(_module(), "DefaultPoolConfigurator", None)
    if cls is None or not callable(getattr(cls, "calculate_pool_sizes", None)):
        raise RuntimeError(f"{TARGET}.DefaultPoolConfigurator.calculate_pool_sizes is gone")
    src = _source(cls.calculate_pool_sizes)
    if "self._cell_size" not in src:
        raise RuntimeError(
            f"{TARGET}: calculate_pool_sizes no longer divides by self._cell_size;"
            " patch specblock_kv_budget needs updating"
        )


def _source(fn: object) -> str:
    import inspect

    return inspect.getsource(fn)


def is_specblock(spec_algorithm: object) -> bool:
    return getattr(spec_algorithm, "name", None) == "SPECBLOCK"


def hosts_specblock(spec_algorithm: object) -> bool:
    """MINEDRAFT with the SpecBlock drafter in its draft server."""
    if getattr(spec_algorithm, "name", None) != "MINEDRAFT":
        return False
    return SpecConfig.from_env().minedraft_drafter == "specblock"


def feature_bytes_per_token(dtype: object) -> int:
    """Bytes per target KV location of MINEDRAFT's feature cache for the hosted drafter."""
    import torch

    from sgl_spec.specblock.settings import read_drafter_config, resolve_drafter_path

    config = read_drafter_config(resolve_drafter_path(SpecConfig.from_env().specblock_drafter_path))
    return 3 * config.target_hidden_size * torch.empty((), dtype=dtype).element_size()


def drafter_bytes_per_token(dtype: object) -> int:
    """Bytes per target KV location of the configured drafter (0 without one)."""
    from sgl_spec.specblock.draft_kv import drafter_kv_bytes_per_row
    from sgl_spec.specblock.settings import load_settings, read_drafter_config

    settings = load_settings(SpecConfig.from_env())
    return drafter_kv_bytes_per_row(read_drafter_config(settings.drafter_path), dtype)


def counting_drafter(original: Callable[..., None]) -> Callable[..., None]:
    """``DefaultPoolConfigurator.__init__`` that adds the drafter's bytes to the cell size."""

    def __init__(self, kvc, *args, **kwargs) -> None:
        original(self, kvc, *args, **kwargs)
        if kvc.is_draft_worker or not self._cell_size:
            return
        import torch

        dtype = getattr(kvc.model_config, "dtype", torch.float32)
        if is_specblock(kvc.spec_algorithm):
            name, extra, what = "SPECBLOCK", drafter_bytes_per_token(dtype), "drafter"
        elif hosts_specblock(kvc.spec_algorithm):
            name, extra, what = "MINEDRAFT", feature_bytes_per_token(dtype), "target features"
        else:
            return
        logger.info(
            "%s: KV budget per token %d B (target) + %d B (%s)",
            name, self._cell_size, extra, what,
        )  # fmt: skip
        self._cell_size += extra

    __init__._sgl_spec_specblock = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def apply() -> bool:
    check()
    cls = _module().DefaultPoolConfigurator
    if not getattr(cls.__init__, "_sgl_spec_specblock", False):
        cls.__init__ = counting_drafter(cls.__init__)
    return True
