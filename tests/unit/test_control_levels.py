"""``HostLevels`` (``sgl_spec/control/levels.py``) behind ``StepTimes``: τ = T(0)/T(k) from
steps a few apart, whatever the host's speed does meanwhile."""

from __future__ import annotations

import random

import pytest

from sgl_spec.control.levels import STALE_SAMPLES, HostLevels
from sgl_spec.control.step_times import StepTimes


def feed(times: StepTimes, k: int, seconds: list[float], bs: int = 1) -> None:
    for s in seconds:
        times.update(bs, k, s)


def test_tau_holds_while_the_host_slows_during_one_setting() -> None:
    """T(0) measured at 10 ms, then k = 2 runs 60 steps while the host slows by half (every
    step 1.5x by the end; k = 2 costs 1/0.7 of a plain step throughout), then one plain step
    refreshes T(0): τ(2) stays 0.7. Dividing the two windows' lower quartiles, as before, reads
    the old fast plain steps against the k = 2 window's slow ones and says 0.48."""
    times = StepTimes(window=9, min_samples=3, paired=True)
    feed(times, 0, [0.010] * 9)
    feed(times, 2, [0.010 / 0.7 * (1 + 0.5 * i / 59) for i in range(60)])
    feed(times, 0, [0.015])
    tau = times.get(1, 0) / times.get(1, 2)
    assert tau == pytest.approx(0.7, rel=0.03)
    raw = times._lower_quartile(0, 0) / times._lower_quartile(0, 2)
    assert raw < 0.55  # the estimate this replaces (the test fails without the level model)


def test_offsets_learn_from_noisy_switches() -> None:
    """Settings 0, 1, 2 interleave in stretches under multiplicative noise and a drifting host:
    τ(1) = 0.85 and τ(2) = 0.7 are found within 5%."""
    rng = random.Random(7)
    times = StepTimes(window=9, min_samples=3, paired=True)
    host = 0.010
    for stretch in range(120):
        k = (0, 2, 2, 1, 2)[stretch % 5]
        for _ in range(rng.randint(2, 12)):
            host *= 1 + rng.uniform(-0.03, 0.03)
            noise = 1 + abs(rng.gauss(0, 0.05))
            times.update(1, k, host * noise / (1, 0.85, 0.7)[k])
    t0 = times.get(1, 0)
    assert t0 / times.get(1, 1) == pytest.approx(0.85, rel=0.05)
    assert t0 / times.get(1, 2) == pytest.approx(0.7, rel=0.05)


def test_a_burst_moves_every_setting_alike() -> None:
    """A burst of contention doubles five steps at k = 2: T(0) and T(2) follow it together, τ
    keeps its value, and both come back after it."""
    times = StepTimes(window=9, min_samples=3, paired=True)
    feed(times, 0, [0.010] * 9)
    feed(times, 2, [0.014] * 6)
    before = times.get(1, 0) / times.get(1, 2)
    feed(times, 2, [0.028] * 5)
    assert times.get(1, 2) > 0.02
    assert times.get(1, 0) / times.get(1, 2) == pytest.approx(before, rel=1e-6)
    feed(times, 2, [0.014] * 20)
    assert times.get(1, 2) == pytest.approx(0.014, rel=0.02)


def test_stale_bucket_is_anchored_anew_and_settings_before_t0_are_placed() -> None:
    """A bucket unvisited for longer than ``STALE_SAMPLES`` takes its next sample's level as is
    (no pairing against an old level); samples of k before any T(0) in a bucket give k's offset
    from their lower quartile once T(0) comes."""
    levels = HostLevels()
    levels.feed(2, 1, 0.030, dict)
    assert levels.seconds(2, 1) is None and levels.seconds(2, 0) is None
    levels.feed(2, 0, 0.020, lambda: {1: 0.030})
    assert levels.seconds(2, 1) == pytest.approx(0.030)
    for _ in range(STALE_SAMPLES + 1):
        levels.feed(0, 0, 0.010, dict)
    levels.feed(2, 1, 0.060, dict)  # the host is twice as slow now: re-anchored, offset kept
    assert levels.seconds(2, 1) == pytest.approx(0.060)
    assert levels.seconds(2, 0) == pytest.approx(0.040)
