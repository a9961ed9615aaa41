"""Step times as a host level and per-setting offsets, so that τ = T(0)/T(k) compares steps
run under the same conditions.

On a shared host the speed of every step drifts by tens of percent within a minute. T(0) and
T(k) are sampled at different times -- T(k) while setting k runs, T(0) while speculation is off
or in a refresh every few hundred steps -- so two windows' quantiles divide times of different
ages, and the ratio follows the drift more than the settings. ``HostLevels`` models the log of
a step's seconds as ``level + offset[k]``: the level (log T(0) now, per batch-size bucket) moves
with every step, whatever its setting; ``offset[k]`` (0 for k = 0) is learnt only from the
first samples after a switch of setting, against the level the setting before it left there,
so that a drift while one setting runs moves the level and not the offsets. τ(k) =
exp(-offset[k]) then pairs steps a few apart. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# Weight of a step in the level: it follows the host within a few steps.
LEVEL_WEIGHT = 0.3
# Weight of a paired sample in an offset once it has this many inverses' worth of samples (a
# running mean before that).
OFFSET_WEIGHT = 0.1
# Samples after a switch of setting that pair with the level the setting before left.
PAIRED_SAMPLES = 3
# A bucket not sampled for this many samples of the others has a level too old to pair
# against: its next sample sets it anew.
STALE_SAMPLES = 32
# The most one sample may move the level or an offset, in log seconds: a burst of host
# contention lasts a few steps and should not decide.
RESIDUAL_CLIP = 0.25


@dataclass
class HostLevels:
    """Per batch-size bucket: the log level of a plain step now and the log offset of each
    setting k > 0 from it (module docstring). Fed one sample (seconds) at a time."""

    _level: dict[int, float] = field(default_factory=dict)
    _fed: dict[int, int] = field(default_factory=dict)  # the clock of a bucket's last sample
    _offset: dict[tuple[int, int], float] = field(default_factory=dict)
    _paired: dict[tuple[int, int], int] = field(default_factory=dict)  # samples in an offset
    _run: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # (k, length, k before)
    _clock: int = 0

    def feed(
        self, bucket: int, k: int, seconds: float, anchors: Callable[[], dict[int, float]]
    ) -> None:
        """One sample of setting k in ``bucket``. ``anchors()``: seconds of the settings of
        this bucket as the caller's raw estimate has them, to place the settings sampled before
        the bucket's first plain step (called then only)."""
        self._clock += 1
        log_s = math.log(seconds)
        last = self._run.get(bucket)
        if last is not None and last[0] == k:
            run = (k, last[1] + 1, last[2])
        else:
            run = (k, 1, -1 if last is None else last[0])
        self._run[bucket] = run
        level = self._level.get(bucket)
        fresh = level is not None and self._clock - self._fed.get(bucket, 0) <= STALE_SAMPLES
        self._fed[bucket] = self._clock
        offset = self._offset_of(bucket, k)
        if level is None and k == 0:
            self._level[bucket] = log_s
            for j, seconds_j in anchors().items():
                if j > 0 and (bucket, j) not in self._offset:
                    self._set_offset(bucket, j, math.log(seconds_j) - log_s)
            return
        if level is None:
            return  # nothing to place a setting's first time against: the raw estimate speaks
        if offset is None:
            self._set_offset(bucket, k, log_s - level)
            return
        if not fresh:
            self._level[bucket] = log_s - offset  # re-anchored
            return
        residual = min(max(log_s - level - offset, -RESIDUAL_CLIP), RESIDUAL_CLIP)
        before = run[2]
        if run[1] <= PAIRED_SAMPLES and before >= 0 and before != k:
            if k > 0:
                self._learn(bucket, k, residual)
            elif (bucket, before) in self._offset:
                self._learn(bucket, before, -residual)
            return
        self._level[bucket] = level + LEVEL_WEIGHT * residual

    def seconds(self, bucket: int, k: int) -> float | None:
        """T(k) now in ``bucket``, or None where the level or k's offset is not known."""
        level, offset = self._level.get(bucket), self._offset_of(bucket, k)
        if level is None or offset is None:
            return None
        return math.exp(level + offset)

    def _offset_of(self, bucket: int, k: int) -> float | None:
        """k's log offset in ``bucket`` (0 for a plain step; None before k is placed)."""
        return 0.0 if k == 0 else self._offset.get((bucket, k))

    def _set_offset(self, bucket: int, k: int, value: float) -> None:
        self._offset[(bucket, k)] = value
        self._paired[(bucket, k)] = 1

    def _learn(self, bucket: int, k: int, residual: float) -> None:
        n = self._paired.get((bucket, k), 0) + 1
        self._paired[(bucket, k)] = n
        self._offset[(bucket, k)] += max(OFFSET_WEIGHT, 1.0 / n) * residual
