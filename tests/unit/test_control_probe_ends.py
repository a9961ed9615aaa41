"""sgl_spec.control.controller: a probe ends early once what it has measured shows the setting
it is for cannot pay at the batch's plausible acceptance (``plausible_probes``).

A setting not measured at a batch size is probed until ``min_samples`` samples are in (12
steps for a draft chain's 4-step samples). At a large batch a verify of several tokens per
request costs several plain steps, so such a probe loses most of them; its first two samples
(``StepTimes.provisional``) already bound the setting's τ, and the probe stops there."""

from __future__ import annotations

from sgl_spec.control.chain_steps import steps_controller
from sgl_spec.control.controller import SpeculationController
from sgl_spec.control.step_times import StepTimes
from tests.unit.test_control_plausible import serve


def _drafted(ctrl: SpeculationController, cost) -> list[int]:
    return [k for k in serve(ctrl, 16, 400, cost) if k]


def test_first_samples_are_provisional_until_measured() -> None:
    times = StepTimes(window=9, min_samples=3, chunk=2)
    assert times.provisional(16, 1) is None
    times.update(16, 1, 0.05)
    times.update(16, 1, 0.07)  # one sample, 2 steps: too few to stand for the setting
    assert times.provisional(16, 1) is None
    times.update(16, 1, 0.03)
    times.update(16, 1, 0.03)
    assert times.provisional(16, 1) == 0.03  # the least of 0.06, 0.03: noise only adds time
    assert times.get(16, 1) is None
    times.update(16, 1, 0.04)
    times.update(16, 1, 0.04)
    assert times.get(16, 1) is not None and times.provisional(16, 1) is None
    single = StepTimes(window=9, min_samples=3, chunk=1)  # samples of one step never count
    for seconds in (0.05, 0.05):
        single.update(16, 1, seconds)
    assert single.provisional(16, 1) is None


def test_a_chains_first_sample_never_stands_alone() -> None:
    """A draft chain's first 4-step sample holds the step that switched it on, which costs
    several plain steps (a served STANDALONE_FULL probe after bench_serving's flush: T(1)'s
    first sample 16.4 ms against T(0) 8.4 ms, RESULTS.md 2026-12-07); alone it would end the
    probe of a setting that pays. It counts beside the next one, the least of the two."""
    times = StepTimes(window=9, min_samples=3, chunk=4)
    for seconds in (0.040, 0.009, 0.009, 0.008):
        times.update(1, 1, seconds)
    assert times.provisional(1, 1) is None
    for seconds in (0.009, 0.010, 0.009, 0.010):
        times.update(1, 1, seconds)
    assert times.provisional(1, 1) == 0.0095


def test_a_probe_ends_when_its_first_sample_rules_its_setting_out() -> None:
    """16 requests, a chain of k drafts costing 1 + 2k plain steps, one draft accepted a
    request: k = 1 (3 plain steps for at most 2 tokens) is probed at calibration and the
    chain of 3 later while off; each probe ends with its second 4-step sample (the first, with
    the switch in it, never stands alone). Without the rule each runs its 12 steps."""
    cost = lambda k: 1 + 2 * k  # noqa: E731
    ctrl = steps_controller(3)
    drafted = _drafted(ctrl, cost)
    assert drafted == [1] * 8 + [3] * 8
    assert ctrl.times.get(16, 1) is None and ctrl.times.provisional(16, 1) is not None

    before = steps_controller(3)
    before._ruled_out = lambda *args: False  # type: ignore[method-assign]
    assert len(_drafted(before, cost)) >= 24


def test_a_probe_for_a_setting_that_could_still_pay_runs_on() -> None:
    """k = 1 costs 1.2 plain steps at 16 requests and every request accepts its draft: its
    first sample shows it pays, so its probe runs until k = 1 is measured, and then the
    controller drafts on merit."""
    cost = lambda k: 1 + 0.2 * k  # noqa: E731
    ctrl = steps_controller(3)
    drafted = _drafted(ctrl, cost)
    assert ctrl.times.get(16, 1) is not None
    assert len(drafted) > 200


def test_acceptance_alone_never_ends_a_probe() -> None:
    """A probe's setting whose acceptance then falls to nothing runs on (a step or two of
    acceptance says little), also where the batch grows into another batch-size bucket
    meanwhile (its steps measure that bucket: ending such probes served slower, RESULTS.md)."""
    ctrl = steps_controller(3)
    serve(ctrl, 16, 300, lambda k: 1 + 0.2 * k)  # 16 requests: T(0) and T(1) measured
    ctrl._start_probe(ctrl.predict(1, 16, 256), 16, steps=12)
    ctrl.acceptance.alphas = [0.0] * 3
    ctrl.acceptance.population = [0.0] * 3
    assert not ctrl.could_pay(ctrl.predict(1, 16, 256), 16)
    assert ctrl.decide(16, 256).k == 1  # the probe runs on
    assert ctrl.decide(32, 256).k == 1  # carried into a wave, too
