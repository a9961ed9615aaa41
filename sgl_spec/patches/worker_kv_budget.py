"""Patch: SGLang's KV budget counts the memory our workers keep per target KV location.

Upstream target: ``sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator``
(SGLang 0.5.23). SGLang sizes the target's KV pool from free device memory and the per-token
cost of the target's layers (plus EAGLE/STANDALONE/DFLASH draft layers, which it knows). A
worker of ours may keep rows of its own beside each target KV location, allocated after the
target pool (a drafter's KV cache, cached target features); uncounted, a drafter with 2 layers
and K = 4 doubles the KV memory of an 8-layer target and the server is killed for memory at
start-up. This patch adds the algorithm's bytes per location
(``Algorithm.extra_kv_bytes_per_token``) to the per-token cell size, so the pools together fit
the budget SGLang would have given the target alone. ``--max-total-tokens`` still wins (SGLang
then skips the budget), as it does for SGLang's own draft pools.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.model_executor.pool_configurator"
logger = logging.getLogger(__name__)


def enabled(config: SpecConfig) -> bool:
    del config
    return True


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
            " patch worker_kv_budget needs updating"
        )


def _source(fn: object) -> str:
    import inspect

    return inspect.getsource(fn)


def extra_bytes_per_token(spec_algorithm: object, server_args: object, dtype: object) -> int:
    """Bytes per target KV location that the algorithm's worker keeps (0 for SGLang's own)."""
    from sgl_spec.algorithms import find

    algorithm = find(getattr(spec_algorithm, "name", None))
    if algorithm is None:
        return 0
    settings = algorithm.process_settings(server_args)
    return algorithm.extra_kv_bytes_per_token(settings, dtype)


def counting_worker_rows(original: Callable[..., None]) -> Callable[..., None]:
    """``DefaultPoolConfigurator.__init__`` that adds the worker's bytes to the cell size."""

    def __init__(self, kvc, *args, **kwargs) -> None:
        original(self, kvc, *args, **kwargs)
        if kvc.is_draft_worker or not self._cell_size:
            return
        import torch

        dtype = getattr(kvc.model_config, "dtype", torch.float32)
        extra = extra_bytes_per_token(kvc.spec_algorithm, kvc.server_args, dtype)
        if not extra:
            return
        logger.info(
            "%s: KV budget per token %d B (target) + %d B (worker)",
            kvc.spec_algorithm.name, self._cell_size, extra,
        )  # fmt: skip
        self._cell_size += extra

    __init__._sgl_spec_worker_rows = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def apply() -> bool:
    check()
    cls = _module().DefaultPoolConfigurator
    if not getattr(cls.__init__, "_sgl_spec_worker_rows", False):
        cls.__init__ = counting_worker_rows(cls.__init__)
    return True
