"""Steady step times (``ControllerConfig.steady_times``): the first step after a switch of
setting costs more than the ones after it, so only steps that follow a step at their own
setting are timed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sgl_spec.control.config import CHAIN_TUNING, ControllerConfig
from sgl_spec.control.controller import SpeculationController
from sgl_spec.control.cost_model import DrafterCost
from sgl_spec.control.step_times import StepClock


def test_step_clock_says_whether_a_step_followed_its_own_setting() -> None:
    clock = StepClock()
    clock.tick(("a",), 0.0)
    clock.chosen(0, 1)
    assert clock.tick(("a",), 1.0) == (0, 1, 1.0) and not clock.steady  # nothing before it
    clock.chosen(0, 1)
    assert clock.tick(("a",), 2.0) == (0, 1, 1.0) and clock.steady  # 0 after 0
    clock.chosen(2, 1)
    assert clock.tick(("a",), 3.0) == (2, 1, 1.0) and not clock.steady  # 2 after 0: a switch
    clock.chosen(2, 1)
    assert clock.tick(("a",), 4.0) == (2, 1, 1.0) and clock.steady
    clock.chosen(0, 1)
    assert clock.tick(("a", "b"), 5.0) is None and not clock.steady  # a join: not measured
    clock.chosen(0, 2)
    assert clock.tick(("a", "b"), 6.0) == (0, 2, 1.0) and clock.steady  # 0 after 0 again


def serve_one_request(
    config: ControllerConfig, num_steps: int, accept: bool = True
) -> tuple[SpeculationController, list[int]]:
    """One request whose every draft is accepted (none with ``accept`` false); a step of k drafts costs 10 + 5k ms, and
    3 ms more when the step before it ran another k (the switch). Returns the controller and
    the k of each step."""
    ctrl = SpeculationController(None, DrafterCost(0.0), config)
    clock, now, before, chosen = StepClock(), 0.0, -1, []
    for _ in range(num_steps):
        clock.start(("a",), now, ctrl)
        k = ctrl.choose_k(1, 100)
        clock.chosen(k, 1)
        chosen.append(k)
        now += 0.010 + 0.005 * k + (0.003 if k != before else 0.0)
        before = k
        if k:
            ctrl.observe(k, [k if accept else 0])
    return ctrl, chosen


@pytest.mark.parametrize("steady", [True, False])
def test_t0_while_speculating_is_a_plain_steps_cost_not_a_switchs(steady: bool) -> None:
    """Speculating, T(0) is refreshed by plain steps that each follow a drafted step. Timed,
    those 13 ms steps make speculation look better than it is (τ(4) over 5% above its 1/3)
    and keep a k that no longer pays; steady times keep T(0) at the 10 ms of plain steps in a
    row and τ(4) at 1/3."""
    config = ControllerConfig(k_max=4, alpha_prior=0.7, **{**CHAIN_TUNING, "steady_times": steady})
    ctrl, _ = serve_one_request(replace(config, refresh_every=16), 1200)
    assert ctrl.num_steps_on > 0  # it speculates: all drafts accepted, S(4) = 5 * 10 / 30
    t0 = ctrl.times.get(1, 0)
    tau = t0 / ctrl.times.get(1, 4)
    if steady:
        assert t0 == pytest.approx(0.010) and tau == pytest.approx(1 / 3)
    else:
        assert tau > 1.05 / 3  # what the option is for


def test_a_probe_of_a_setting_not_measured_runs_until_its_time_is_measured() -> None:
    """With steady times a calibration probe runs one step more than the samples it needs
    (its first step is not timed), so one probe measures the setting (which, nothing
    accepted, is then left off once the acceptance estimate falls)."""
    config = ControllerConfig(k_max=1, alpha_prior=0.7, **CHAIN_TUNING)
    _, chosen = serve_one_request(config, 60, accept=False)
    first = chosen.index(1)
    steps = config.calibrate_steps + 1
    assert chosen[first : first + steps] == [1] * steps and chosen[-1] == 0
    ctrl, _ = serve_one_request(config, first + steps + 1, accept=False)  # the last one timed
    assert ctrl.times.get(1, 1) == pytest.approx(0.015)  # measured, the switch left out


def test_chain_controllers_time_steady_steps_and_specblocks_every_step() -> None:
    """MTP_LORA and MINEDRAFT (``CHAIN_TUNING``) time steady steps; SPECBLOCK's budget
    controller every step (its drafter's catch-up is left out and priced on its own, and
    steady times measured no better there)."""
    from sgl_spec.control.budget import budget_controller

    assert CHAIN_TUNING["steady_times"] is True
    assert budget_controller((1, 2, 4), (0, 1, 3)).config.steady_times is False
