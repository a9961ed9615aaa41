"""Served step times per batch-size bucket and number of drafts, for online calibration.

The offline γ table times a bare forward; a served step also pays the method's own work, so
``SpeculationController`` (``controller.py``) can measure τ = T(0)/T(k) from the worker's step
times instead. ``StepTimes`` keeps the lower quartile of the recent ones per (bucket, k), or
with ``paired`` prices them from a host level and offsets learnt at switches (``levels.py``);
``StepClock`` measures a step from its start to the next one's. Pure.

Where the batch turns over every step or two (a chain that commits several tokens per
request at high concurrency) the steps that stay alike are not the typical ones: the step
after a join pays more (a prefill ran before it; a draft model first takes the new prompt).
``StepTimes(chunk=n)`` and ``StepClock`` measuring across batch changes
(``ControllerConfig.time_batch_changes``) then price a setting by what it serves: means of
``n`` steps, each up to the next decode step whatever ran between, so that the share of
post-join steps each setting causes is in its time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sgl_spec.control.levels import HostLevels

# The least share of T(0) by which a setting must cost more than a plain step for the ratio of
# two settings' extra costs to be read (``StepTimes.extra_ratio_from_smaller_batch``).
SIGNIFICANT_EXTRA = 0.1
# The fewest steps a setting's samples must span before they stand for its time while it is
# not measured yet (``StepTimes.provisional``, which also needs two samples).
PROVISIONAL_STEPS = 4


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share timing statistics per power of two (rounded in log space)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return round(math.log2(batch_size))


@dataclass
class StepTimes:
    """Lower quartile of the last ``window`` served step seconds per (batch-size bucket, k)
    (the smallest of 3, the 3rd smallest of 9); a value counts as measured once it has
    ``min_samples`` observations. Noise only ever adds time: the first steps after start-up
    (lazy initialisation) and bursts of host contention make steps several times slower. T(0)
    and T(k) are sampled at different times, so a median still follows a burst that lasts
    half a window and makes a slower k look cheap; a low quantile keeps the cost of the step
    itself."""

    window: int = 9
    min_samples: int = 3
    chunk: int = 1
    """Observations averaged into one sample (module docstring): a sample is the mean of
    ``chunk`` steps of the same (bucket, k), and counts and the window are in samples."""
    paired: bool = False
    """Prices from a host level and per-setting offsets learnt at switches (``levels.py``)
    where they place a setting, instead of each window's lower quartile."""
    _samples: dict[tuple[int, int], deque] = field(default_factory=dict, repr=False)
    _counts: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)
    _pending: dict[tuple[int, int], list[float]] = field(default_factory=dict, repr=False)
    _levels: HostLevels = field(default_factory=HostLevels, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_samples <= self.window:
            raise ValueError(
                f"need 1 <= min_samples <= window, got {self.min_samples}, {self.window}"
            )
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")

    def update(self, batch_size: int, k: int, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return  # a clock hiccup says nothing about cost
        key = (batch_bucket(batch_size), k)
        pending = self._pending.setdefault(key, [])
        pending.append(seconds)
        if len(pending) < self.chunk:
            return
        sample = sum(pending) / len(pending)
        self._samples.setdefault(key, deque(maxlen=self.window)).append(sample)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self.paired:
            self._levels.feed(key[0], k, sample, lambda: self._raw_bucket(key[0]))
        pending.clear()

    def steps_to_measure(self, batch_size: int, k: int) -> int:
        """Observations (steps) still needed before T(k) counts as measured in this bucket."""
        key = (batch_bucket(batch_size), k)
        missing = self.min_samples - self._counts.get(key, 0)
        return max(0, missing * self.chunk - len(self._pending.get(key, ())))

    def get(self, batch_size: int, k: int) -> float | None:
        return self._get_bucket(batch_bucket(batch_size), k)

    def provisional(self, batch_size: int, k: int) -> float | None:
        """The least sample of (bucket, k) once it has two samples and ``PROVISIONAL_STEPS``
        steps' worth but fewer than ``min_samples`` samples (else None): what a probe has
        measured so far. Noise only adds time, so it overstates the setting's cost while a
        burst lasts; ``bounds.tau_bound`` takes it all the same, to end a probe that has
        already shown its setting cannot pay. The first step after a switch costs more than
        the next ones, so the first sample never stands alone: samples of single steps never
        count, and a draft chain's first 4-step sample (the switch inside it) counts only
        beside a second."""
        key = (batch_bucket(batch_size), k)
        count = self._counts.get(key, 0)
        if count < 2 or count * self.chunk < PROVISIONAL_STEPS or count >= self.min_samples:
            return None
        return min(self._samples[key])

    def count(self, batch_size: int, k: int) -> int:
        return self._counts.get((batch_bucket(batch_size), k), 0)

    def tau_from_smaller_batch(self, batch_size: int, k: int) -> float | None:
        """T(0)/T(k) of the nearest smaller batch-size bucket where both are measured.

        τ does not rise with batch size (a larger batch leaves less idle compute for the extra
        tokens, seed paper §4.1), so this bounds τ(k) of ``batch_size``'s bucket from above
        before that bucket has measured k itself."""
        for b in self._smaller_buckets(batch_size, k):
            t0, tk = self._get_bucket(b, 0), self._get_bucket(b, k)
            if t0 is not None and tk is not None:
                return t0 / tk
        return None

    def extra_ratio_from_smaller_batch(self, batch_size: int, j: int, k: int) -> float | None:
        """(T(k) - T(0)) / (T(j) - T(0)), j < k, of the nearest smaller batch-size bucket where
        the three are measured, at least 1 (T(k) >= T(j)); None if there is none, or if setting j
        costs less than ``SIGNIFICANT_EXTRA`` more than a plain step there (the ratio would be
        mostly noise; a farther bucket, with less idle compute still, says less).

        How much more setting k costs than j, over what j costs more than a plain step, does
        not fall as the batch grows: at a small batch a fixed cost of drafting at all dominates
        both (the ratio is near 1), at a large one the work per drafted token (the ratio
        approaches that of their tokens). ``SpeculationController`` bounds T(k) of a bucket that
        measured j but not k with it."""
        for b in self._smaller_buckets(batch_size, k):
            t0, tj, tk = (self._get_bucket(b, i) for i in (0, j, k))
            if t0 is None or tj is None or tk is None:
                continue
            if tj - t0 < SIGNIFICANT_EXTRA * t0:
                return None
            return max(1.0, (tk - t0) / (tj - t0))
        return None

    def _smaller_buckets(self, batch_size: int, k: int) -> list[int]:
        """The buckets below ``batch_size``'s with samples of setting k, nearest first."""
        bucket = batch_bucket(batch_size)
        return sorted({b for b, i in self._samples if i == k and b < bucket}, reverse=True)

    def _get_bucket(self, bucket: int, k: int) -> float | None:
        """T(k) of ``bucket`` once measured: the host level's model (``levels.py``) where it
        places k, else the lower quartile of k's window."""
        if self._counts.get((bucket, k), 0) < self.min_samples:
            return None
        modelled = self._levels.seconds(bucket, k) if self.paired else None
        return modelled if modelled is not None else self._lower_quartile(bucket, k)

    def _lower_quartile(self, bucket: int, k: int) -> float:
        samples = sorted(self._samples[(bucket, k)])
        return samples[(len(samples) - 1) // 4]

    def _raw_bucket(self, bucket: int) -> dict[int, float]:
        """The lower quartile of every setting sampled in ``bucket``."""
        return {k: self._lower_quartile(b, k) for b, k in self._samples if b == bucket}


class StepClock:
    """What a decode step costs the server: the seconds from its start to the start of the
    next decode step, so that the scheduler's work on its output (and anything else the
    serving loop does per step) is charged to the setting that caused it.

    By default a step is measured only when the next one runs exactly the same requests
    (``key``): a new request means a prefill ran in between, a finished one that the batch
    changed shape; the lower quartile of ``StepTimes`` drops the steps that waited on something
    else. ``across_changes`` measures up to the next decode step that shares a request with
    this one, prefills between included (module docstring); a next step of none of the same
    requests follows an idle server or a client's round trip, and is never measured."""

    def __init__(self) -> None:
        self._last: tuple[float, object, int, int] | None = None  # (start, key, k, batch size)
        self._before = -1  # the setting of the step before the one ``_last`` holds
        self.steady = False
        """Whether the step the last ``tick`` measured followed a step at its own setting:
        the first step after a switch costs more than the ones after it (``observe_step``)."""

    def tick(
        self, key: tuple, now: float, across_changes: bool = False
    ) -> tuple[int, int, float] | None:
        """A decode step of the requests ``key`` starts at ``now`` (``time.perf_counter``);
        returns ``(k, batch_size, seconds)`` of the previous step if it ran the same ones (with
        ``across_changes``: any of them)."""
        last, self._last = self._last, (now, key, -1, 0)
        before, self._before = self._before, -1 if last is None else last[2]
        self.steady = False
        if last is None or last[2] < 0:
            return None
        self.steady = before == last[2]
        same = last[1] == key or (across_changes and not set(key).isdisjoint(last[1]))
        return (last[2], last[3], now - last[0]) if same else None

    def start(self, key: tuple, now: float, controller: Any) -> None:
        """A decode step of the requests ``key`` starts at ``now``: ``controller`` (a
        ``SpeculationController``) learns what the previous step cost and, when the batch
        changed, who joined it (``batch_changed``)."""
        previous = self.last_key
        config = getattr(controller, "config", None)
        across = bool(getattr(config, "time_batch_changes", False))
        measured = self.tick(key, now, across)
        if measured is not None:
            controller.observe_step(*measured, steady=self.steady)
        if previous is not None and key != previous:  # who joined, who left
            controller.batch_changed(len(set(key).difference(previous)), len(key))

    @property
    def last_key(self) -> object | None:
        """The requests of the step the last ``tick`` started (None before any)."""
        return None if self._last is None else self._last[1]

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of the step the last ``tick`` started out of its measured time:
        one-off work a switch of setting brings (a drafter reading what it skipped while off),
        not a cost of every step at that setting."""
        if self._last is not None:
            self._last = (self._last[0] + seconds, *self._last[1:])

    def chosen(self, k: int, batch_size: int) -> None:
        """The step started by the last ``tick`` runs setting ``k`` for ``batch_size``."""
        if self._last is not None:
            self._last = (self._last[0], self._last[1], k, batch_size)
