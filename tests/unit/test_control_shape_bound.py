"""sgl_spec.control: the bound on an unmeasured setting's step time from how the settings' extra
costs compared at a smaller batch (``StepTimes.extra_ratio_from_smaller_batch``, used by
``bounds.tau_bound``). At 16 requests on the 2-vCPU host, budget 2 cost 3x a
plain step and budget 8 6-7x; with only "T(8) >= T(2)" to go by, budget 8 looked as if it could
pay and was probed at every new wave of requests, 3 steps of ~6 plain steps each."""

from __future__ import annotations

import pytest

from sgl_spec.control.bounds import SHAPE_SLACK
from sgl_spec.control.budget import budget_controller
from sgl_spec.control.step_times import StepTimes

BUDGETS = (1, 2, 4, 8)
MAX_DRAFTS = (0, 1, 3, 7)


def fill(times: StepTimes, batch_size: int, seconds: dict[int, float]) -> None:
    for k, value in seconds.items():
        for _ in range(times.min_samples):
            times.update(batch_size, k, value)


def test_extra_ratio_of_the_nearest_smaller_bucket() -> None:
    times = StepTimes(window=9, min_samples=3)
    fill(times, 1, {0: 0.010, 1: 0.020, 3: 0.022})
    fill(times, 8, {0: 0.010, 1: 0.020, 3: 0.040})
    assert times.extra_ratio_from_smaller_batch(16, 1, 3) == pytest.approx(3.0)  # from 8
    assert times.extra_ratio_from_smaller_batch(4, 1, 3) == pytest.approx(1.2)  # from 1
    assert times.extra_ratio_from_smaller_batch(1, 1, 3) is None  # nothing smaller


def test_extra_ratio_needs_a_visible_extra_and_is_at_least_one() -> None:
    times = StepTimes(window=9, min_samples=3)
    fill(times, 8, {0: 0.010, 1: 0.0105, 3: 0.030})  # j costs 5% more: noise
    assert times.extra_ratio_from_smaller_batch(16, 1, 3) is None
    times = StepTimes(window=9, min_samples=3)
    fill(times, 8, {0: 0.010, 1: 0.020, 3: 0.015})  # k measured cheaper than j: T(k) >= T(j)
    assert times.extra_ratio_from_smaller_batch(16, 1, 3) == 1.0


def served(ctrl, batch_size: int, seconds: dict[int, float], accepted: dict[int, int]) -> None:
    """The controller's times and acceptance as if it had served these settings here."""
    for k, value in seconds.items():
        for _ in range(ctrl.times.min_samples):
            ctrl.times.update(batch_size, k, value)
        if k:
            ctrl.observe(k, [accepted[k]] * batch_size)


def test_a_large_budget_is_bounded_by_the_shape_at_a_smaller_batch() -> None:
    """At 8 requests budget 8's extra cost is 3x budget 2's; at 16 budget 2 costs 80 ms against
    25 plain: budget 8 then costs at least 25 + 55 * 3 / SHAPE_SLACK ms -- it cannot pay even
    at the acceptance a batch of 16 plausibly has, so it is not probed there."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    accepted = {1: 1, 2: 1, 3: 2}
    served(ctrl, 8, {0: 0.010, 1: 0.020, 2: 0.030, 3: 0.040}, accepted)
    served(ctrl, 16, {0: 0.025, 1: 0.080}, accepted)
    bound = ctrl.predict(3, 16, 256)
    assert bound.source == "bound"
    least = 0.025 + 0.055 * 3 / SHAPE_SLACK
    assert bound.tau == pytest.approx(0.025 / least)
    assert not ctrl.could_pay(bound, 16)
    # without the shape only T(8) >= T(2) here and τ(8) at 8 requests bound it: worth a probe
    ctrl.times.extra_ratio_from_smaller_batch = lambda *args: None
    assert ctrl.predict(3, 16, 256).tau == pytest.approx(0.010 / 0.040)
    assert ctrl.could_pay(ctrl.predict(3, 16, 256), 16)


def test_the_shape_bound_never_exceeds_the_tokens_ratio() -> None:
    """A ratio of extra costs far above the ratio of verified tokens (noise in small
    differences) is capped there: budget 8 verifies 7 more tokens a request than a plain step,
    budget 2 one more."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    accepted = {1: 1, 3: 3}
    served(ctrl, 8, {0: 0.010, 1: 0.0111, 3: 0.019}, accepted)  # ratio 8.2
    served(ctrl, 16, {0: 0.025, 1: 0.030}, accepted)
    least = 0.025 + 0.005 * 7 / SHAPE_SLACK
    assert ctrl.predict(3, 16, 256).tau == pytest.approx(0.025 / least)


def test_measured_times_take_over_from_the_bound() -> None:
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    accepted = {1: 1, 3: 3}
    served(ctrl, 8, {0: 0.010, 1: 0.020, 3: 0.040}, accepted)
    served(ctrl, 16, {0: 0.025, 1: 0.030, 3: 0.031}, accepted)
    decision = ctrl.predict(3, 16, 256)
    assert decision.source == "measured"
    assert decision.tau == pytest.approx(0.025 / 0.031)


def test_a_cheaper_setting_is_calibrated_first_where_it_would_bound_a_dearer_one() -> None:
    """At 16 requests only τ(8 nodes) <= its value at 8 requests bounds budget 8 (plausibly
    paying there), while budget 2 alone could not pay: calibration measures budget 2 first,
    whose time then bounds budget 8 by the extra-cost shape at 8 requests, and budget 8 is not
    probed."""
    accepted = {1: 1, 2: 1, 3: 4}

    def calibrated(shape_at_8: dict[int, float]) -> list[int]:
        ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
        served(ctrl, 8, shape_at_8, accepted)
        served(ctrl, 16, {0: 0.025}, accepted)
        for _ in range(ctrl.times.window):  # T(0) counts as measured after a full window
            ctrl.times.update(16, 0, 0.025)
        ctrl.num_steps_seen = ctrl.config.warmup_steps
        runs = []
        for _ in range(12):
            k = ctrl.choose_k(16, 256)
            ctrl.observe_step(k, 16, {0: 0.025, 1: 0.080, 2: 0.110, 3: 0.160}[k])
            if k:
                ctrl.observe(k, [accepted[k]] * 16)
            runs.append(k)
        return runs

    runs = calibrated({0: 0.010, 1: 0.020, 2: 0.023, 3: 0.040})  # budget 8's extra 3x budget 2's
    assert runs[:3] == [1, 1, 1] and 3 not in runs
    # without the rule budget 8 would be calibrated first: its bound alone could pay
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    served(ctrl, 8, {0: 0.010, 1: 0.020, 2: 0.023, 3: 0.040}, accepted)
    served(ctrl, 16, {0: 0.025}, accepted)
    assert ctrl.predict(3, 16, 256).predicted_speedup > 1.0 + ctrl.config.margin
    assert ctrl.predict(1, 16, 256).predicted_speedup <= 1.0 + ctrl.config.margin
