"""Patch: a request's row of the token table holds the speculative decode reservation.

Upstream target: ``sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len``
(SGLang 0.5.23, marked there as a temporary fix), read by ``kv_cache_configurator``. Each
``req_to_token`` row is the context length plus ``4 + num_draft_tokens`` slots, but every
speculative decode step reserves ``2 * max(num_steps * topk, num_draft_tokens)`` slots past
the committed length (``get_alloc_reserve_per_decode``). Beyond 4 draft tokens a request that
nears the end of the context writes past its row -- past the whole table for the last row --
and the scheduler dies (``IndexError`` in ``assign_req_to_token_pool``): MTP_LORA's
``(k + 1)²``-token verify and SPECBLOCK's trees reach it. Upstream already sizes the headroom
from the reservation for UNO and paged pools; the patched function does so for every
speculative algorithm (a few int32 per request row).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType

from sgl_spec.config import SpecConfig

TARGET = (
    "sglang.srt.mem_cache.allocation_sizing",
    "sglang.srt.mem_cache.kv_cache_configurator",
)
_NAME = "get_req_to_token_extra_context_len"


def enabled(config: SpecConfig) -> bool:
    return True  # without speculation the reservation (2 slots) is within the headroom


def _modules() -> list[ModuleType]:
    import importlib

    return [importlib.import_module(name) for name in TARGET]


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    sizing, configurator = _modules()
    for name in (_NAME, "get_alloc_reserve_per_decode", "get_alloc_page_size"):
        if not callable(getattr(sizing, name, None)):
            raise RuntimeError(f"{TARGET[0]}.{name} is gone: patch spec_row_headroom")
    if not callable(getattr(configurator, _NAME, None)):
        raise RuntimeError(f"{TARGET[1]} no longer imports {_NAME}")
    source = inspect.getsource(getattr(sizing, _NAME))
    if "4 + (max_speculative_num_draft_tokens() or 0)" not in source:
        raise RuntimeError(f"{TARGET[0]}.{_NAME} changed: patch spec_row_headroom")


def with_reservation(original: Callable[[], int], sizing: ModuleType) -> Callable[[], int]:
    """``original`` raised to the decode reservation (whole pages)."""

    @functools.wraps(original)
    def extra_context_len() -> int:
        reserve = sizing.get_alloc_reserve_per_decode() + sizing.get_alloc_page_size() - 1
        return max(original(), reserve)

    extra_context_len._sgl_spec_row_headroom = True  # type: ignore[attr-defined]
    return extra_context_len


def apply() -> bool:
    """Replace the function in its module and where the pool configurator imported it."""
    check()
    sizing, configurator = _modules()
    original = getattr(sizing, _NAME)
    if not getattr(original, "_sgl_spec_row_headroom", False):
        patched = with_reservation(original, sizing)
        setattr(sizing, _NAME, patched)
        setattr(configurator, _NAME, patched)
    return True
