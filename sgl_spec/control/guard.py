"""A served controller whose failure costs speculation, not the server.

The controller runs inside SGLang's scheduler loop, on every decode step: an exception there (a
bug, a value no test foresaw) would end the scheduler process and every request in flight with
it. ``GuardedController`` forwards every call to the controller it wraps; the first exception is
logged with its traceback, and from then on the controller is not asked again (its state may be
half-updated): every step runs at k = 0, the plain decode step each algorithm already runs when
its controller turns speculation off (lossless), and observations are dropped. Restarting the
server brings the controller back.

Tensor-parallel ranks: the guard sits inside ``ranks.RankZeroDecides``, so rank 0 still
broadcasts a setting (0) after a failure and the other ranks run it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sgl_spec.control.controller import Decision

logger = logging.getLogger(__name__)

# ``Decision.source`` of every decision made after the controller failed.
FAILED = "failed"
# ``steps_to_probe`` after a failure: no drafted step is ever due.
NEVER = 1 << 30


def plain_decision(k: int = 0) -> Decision:
    """The decision after a failure: k = 0, or the ``k`` asked for (``predict``: rank 0's
    setting, which every rank must run), predicted at no gain."""
    return Decision(k, 1.0, k + 1, 1.0, 1.0, source=FAILED)


# What each call of the served interface returns once the controller has failed; a call not
# named here returns None (the observations: ``observe``, ``observe_step``, ``batch_changed`` ...).
_FALLBACKS: dict[str, Callable[..., Any]] = {
    "decide": lambda *args, **kwargs: plain_decision(),
    "best": lambda *args, **kwargs: plain_decision(),
    "predict": lambda k, *args, **kwargs: plain_decision(k),
    "choose_k": lambda *args, **kwargs: 0,
    "expects_drafts": lambda *args, **kwargs: False,
    "steps_to_probe": lambda *args, **kwargs: NEVER,
}
# Attributes whose own methods the scheduler calls (``controller.prices.switched``): guarded
# alike, under the same failure.
_GUARDED_PARTS = ("prices",)


class GuardedController:
    """``controller`` with every method call guarded (module docstring). Attributes read
    through; attributes set or deleted (tests and tools) are the wrapped controller's."""

    def __init__(self, controller: Any, owner: GuardedController | None = None) -> None:
        object.__setattr__(self, "_controller", controller)
        object.__setattr__(self, "_owner", owner)  # the guard whose failure this one shares
        object.__setattr__(self, "_failure", None)
        object.__setattr__(self, "_on_failure", None)

    def when_failed(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` when the controller fails (at once if it has): the
        worker's metrics count it."""
        object.__setattr__(self, "_on_failure", callback)
        if self.failure is not None:
            callback(self.failure)

    @property
    def failure(self) -> str | None:
        """What the controller raised, or None while it has not failed."""
        owner = self._owner
        return self._failure if owner is None else owner.failure

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if self.failure is not None and name in _FALLBACKS:
            return _FALLBACKS[name]
        try:
            value = getattr(self._controller, name)
        except AttributeError:  # no such attribute: callers' getattr(..., default) works
            raise
        except Exception as exc:  # a failing property
            self._failed(exc)
            return None
        if name in _GUARDED_PARTS and self._owner is None:
            return GuardedController(value, owner=self)
        if not callable(value):
            return value
        return lambda *args, **kwargs: self._call(name, value, args, kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._controller, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._controller, name)

    def _call(self, name: str, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.failure is None:
            try:
                return method(*args, **kwargs)
            except Exception as exc:
                self._failed(exc)
        fallback = _FALLBACKS.get(name)
        return None if fallback is None else fallback(*args, **kwargs)

    def _failed(self, exc: Exception) -> None:
        if self.failure is not None:  # logged and counted once
            return
        if self._owner is not None:
            self._owner._failed(exc)
            return
        object.__setattr__(self, "_failure", f"{type(exc).__name__}: {exc}")
        logger.exception(
            "speculation controller failed (%s); every step from now on runs without drafts "
            "(plain decode, output unchanged) until the server restarts",
            self._failure,
        )
        if self._on_failure is not None:
            try:
                self._on_failure(self._failure)
            except Exception:  # counting it must not fail the step either
                logger.exception("could not count the controller's failure")


def guarded(controller: Any) -> Any:
    """``controller`` guarded (``GuardedController``), or None where there is none."""
    return None if controller is None else GuardedController(controller)


def served_controller(controller: Any) -> Any:
    """The controller as a worker holds it: guarded, then agreed across tensor-parallel ranks
    (``ranks.agreed_across_ranks``); None where there is none."""
    from sgl_spec.control.ranks import agreed_across_ranks

    return agreed_across_ranks(guarded(controller))
