"""What a probe costs while speculation is off, and so how long to wait before the next one.

While speculation is off, ``SpeculationController`` probes a setting k > 0 now and then (and
when the batch turns over) so that its acceptance and step-time estimates can recover. Where
drafting is far from paying -- a large batch, where a verify of several tokens per request
costs several plain steps -- each probe step loses what the probe measures: a step of T(k)
that commits λ(k) tokens per request, against λ(k) plain steps of T(0). In plain steps,

    L(k) = T(k) / T(0) - λ(k)      (0 where the probe pays)

``ProbePrices`` keeps the probes' share of serving time under ``budget``: after a probe of
``steps`` steps the next one waits at least ``steps`` · L / ``budget`` steps. L is the larger
of the prediction (measured T(k), running λ(k)) and what recent probes of that batch-size
bucket realised: a probe's first step can cost more than a typical step of its setting (a
draft model first reads the tokens committed while it was off), which the lower quartile of
``StepTimes`` leaves out -- and work an algorithm leaves out of the step's time as a switch's
one-off cost (``switched``: SPECBLOCK's drafter reading every token committed while off) is a
probe's cost all the same, added to its first step. A setting not measured yet in the bucket
is priced from the bound on its τ (the measured times of the settings below it, or of it at a
smaller batch: ``Decision.source`` "bound") and the bucket's realised loss -- a switch costs
the same whatever the setting -- and its probe runs until its time is measured; with no T(0)
at all nothing is priced (L = 0): it is explored. Pure.
"""

from __future__ import annotations

import math
import os

from sgl_spec.control.step_times import batch_bucket

# Weight of a probe step's realised loss in its bucket's running estimate.
REALISED_WEIGHT = 0.25
# The served controllers' budget (``SERVED_TUNING``): 0, no minimum wait, until the price
# shows a gain served (it did not on the 2026-12-02 draw, and at one request it delayed the
# probe of each new request, whose acceptance the population's predicts poorly: RESULTS.md);
# the environment variable sets a share, e.g. 0.03 (for measuring).
BUDGET_ENV = "SGLSPEC_PROBE_BUDGET"
SERVED_BUDGET = 0.0
# The largest batch whose requests, all new at once, are probed whatever the price: a batch of
# one request accepts as that request does, which the population's estimate predicts poorly
# (the shipped drafters accept 1 to 4 tokens a step from one prompt to another); a wave of many
# accepts like the population, and its probe's switch (SPECBLOCK's drafter reading every prompt:
# ~0.5 s at 16 requests of 128 tokens, RESULTS.md) is priced like any other.
UNPRICED_NEW_BATCH = 1


def served_budget(default: float = SERVED_BUDGET) -> float:
    """``default``, or the share ``SGLSPEC_PROBE_BUDGET`` names."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return default
    try:
        budget = float(text)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV} must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= budget < 1.0:
        raise ValueError(f"{BUDGET_ENV} must be a number in [0, 1), got {text!r}")
    return budget


class ProbePrices:
    """The minimum wait between probes while off (module docstring); ``budget`` 0 is no
    minimum."""

    def __init__(self, budget: float, steps: int) -> None:
        if not 0.0 <= budget < 1.0:
            raise ValueError(f"probe_budget must lie in [0, 1), got {budget}")
        self.budget = budget
        self.steps = steps
        self._realised: dict[int, float] = {}  # bucket -> running loss of a probe step
        self._open: tuple[int, int] | None = None  # (k, probe steps not yet observed)
        self._switch_s = 0.0  # switch seconds of the open probe not yet added to a step

    def loss(self, batch_size: int, tau: float, lam: float, known: bool) -> float:
        """Plain steps lost per probe step of a setting of τ = T(0)/T(k), λ(k) = ``lam``
        (``known``: τ from served step times, or an upper bound from them; else nothing is
        known: 0)."""
        if not known or tau <= 0:
            return 0.0
        predicted = max(0.0, 1.0 / tau - lam)
        return max(predicted, self._realised.get(batch_bucket(batch_size), 0.0))

    def wait(
        self, batch_size: int, tau: float, lam: float, known: bool, steps: int | None = None
    ) -> int:
        """Steps from the start of a probe of ``steps`` steps (default ``self.steps``) to the
        next probe's, at least."""
        if not self.budget:
            return 0
        lost = (steps or self.steps) * self.loss(batch_size, tau, lam, known)
        return math.ceil(lost / self.budget)

    def opened(self, k: int, steps: int | None = None) -> None:
        """A probe of setting ``k`` for ``steps`` steps (default ``self.steps``) starts while
        speculation is off (followed only with a budget: without one nothing is priced)."""
        if self.budget:
            self._open = (k, steps or self.steps)
            self._switch_s = 0.0

    def switched(self, seconds: float) -> None:
        """The open probe's step spent ``seconds`` on switching on that its measured time
        leaves out (``StepClock.exclude``): they count in its realised loss."""
        if self._open is not None:
            self._switch_s += seconds

    def observed(
        self, k: int, batch_size: int, seconds: float, t0: float | None, lam: float
    ) -> None:
        """A served step of setting ``k`` took ``seconds`` (T(0) = ``t0`` in its bucket, λ(k)
        = ``lam``); it counts if it is one of the open probe's steps."""
        if self._open is None or k != self._open[0] or t0 is None or t0 <= 0:
            return
        left = self._open[1] - 1
        self._open = (k, left) if left > 0 else None
        bucket = batch_bucket(batch_size)
        lost = max(0.0, (seconds + self._switch_s) / t0 - lam)
        self._switch_s = 0.0
        before = self._realised.get(bucket)
        self._realised[bucket] = (
            lost if before is None else before + REALISED_WEIGHT * (lost - before)
        )
