"""sgl_spec.control.probes: probes while speculation is off priced by what they lose, so that
where drafting is far from paying (a large batch) they cost at most ``probe_budget`` of the
serving time, turnovers included, and where it nearly pays they stay frequent."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sgl_spec.control.budget import PROBE_BUDGET, budget_controller
from sgl_spec.control.chain_steps import steps_controller
from sgl_spec.control.controller import TURNOVER_PROBE_STEPS, SpeculationController
from sgl_spec.control.probes import BUDGET_ENV, ProbePrices, served_budget
from sgl_spec.control.step_times import batch_bucket

BUDGETS = (1, 2, 4, 8)
MAX_DRAFTS = (0, 1, 3, 7)


def test_loss_is_the_plain_steps_a_probe_step_gives_up() -> None:
    prices = ProbePrices(budget=0.05, steps=2)
    # T(k) = 4 T(0) committing 1.5 tokens a request: 2.5 plain steps lost per probe step
    assert prices.loss(32, tau=0.25, lam=1.5, known=True) == pytest.approx(2.5)
    assert prices.wait(32, tau=0.25, lam=1.5, known=True) == 100  # 2 x 2.5 / 0.05
    assert prices.loss(32, tau=0.8, lam=1.5, known=True) == 0.0  # a probe that pays
    assert prices.wait(32, tau=0.25, lam=1.5, known=False) == 0  # unknown: explore
    assert ProbePrices(budget=0.0, steps=2).wait(32, 0.25, 1.5, True) == 0
    assert prices.wait(32, tau=0.25, lam=1.5, known=True, steps=3) == 150  # a longer probe


def test_realised_probe_steps_raise_the_price_in_their_bucket_only() -> None:
    """A probe's first step can cost far more than the setting's typical step (a draft model
    catching up): what the open probe's steps cost counts too, per batch-size bucket."""
    prices = ProbePrices(budget=0.05, steps=2)
    prices.observed(3, 32, seconds=0.5, t0=0.1, lam=2.0)  # no probe open: ignored
    assert prices.loss(32, 0.5, 2.0, True) == 0.0
    prices.opened(3)
    prices.observed(2, 32, seconds=0.5, t0=0.1, lam=2.0)  # another setting: not the probe's
    prices.observed(3, 32, seconds=0.5, t0=0.1, lam=2.0)  # 5 plain steps' time, 2 tokens
    assert prices.loss(32, 0.5, 2.0, True) == pytest.approx(3.0)
    prices.observed(3, 32, seconds=0.2, t0=0.1, lam=2.0)  # the second: 0 lost
    assert prices.loss(32, 0.5, 2.0, True) == pytest.approx(3.0 - 0.25 * 3.0)
    prices.observed(3, 32, seconds=0.9, t0=0.1, lam=2.0)  # the probe is over: ignored
    assert prices.loss(32, 0.5, 2.0, True) == pytest.approx(2.25)
    assert prices.loss(1, 0.5, 2.0, True) == 0.0  # bs 1: another bucket


@pytest.mark.parametrize("budget", [-0.1, 1.0])
def test_bad_budget_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="probe_budget"):
        ProbePrices(budget, 2)
    with pytest.raises(ValueError, match="probe_budget"):
        steps_controller(3, probe_budget=budget)


def serve_off(ctrl: SpeculationController, bs: int, steps: int, turnover_every: int) -> float:
    """``steps`` steps at ``bs`` requests where a budget of n nodes costs 1 + n plain steps and
    every request accepts one draft (nothing pays: a probe loses 1 plain step or more, at
    budget 2), half the batch new every
    ``turnover_every`` steps (0 never); returns the share of time lost to probes."""
    lost = total = 0.0
    for step in range(steps):
        if turnover_every and step % turnover_every == 0:
            ctrl.batch_changed(bs // 2, bs)
        k = ctrl.choose_k(bs, 256)
        seconds = 0.01 * (1 + BUDGETS[k]) if k else 0.01
        ctrl.observe_step(k, bs, seconds)
        accepted = min(MAX_DRAFTS[k], 1) if k else 0
        ctrl.observe(k, [accepted] * bs)
        total += seconds
        lost += max(0.0, seconds - 0.01 * (1 + accepted))
    return lost / total


def test_probes_cost_at_most_their_budget_where_nothing_pays() -> None:
    """SPECBLOCK's tuning probes every 16 steps and on every turnover; with its price of 3%, at
    a large batch where a probe loses most of its steps, probes stay within 3% of the time
    (without a price, over 6%)."""
    priced = budget_controller(BUDGETS, MAX_DRAFTS)
    assert priced.config.probe_budget == PROBE_BUDGET == 0.03  # SPECBLOCK's served default
    unpriced = budget_controller(BUDGETS, MAX_DRAFTS)
    unpriced.prices = ProbePrices(0.0, unpriced.config.probe_steps)
    for ctrl in (priced, unpriced):  # the price alone (plausible probes: below)
        ctrl.config = replace(ctrl.config, plausible_probes=False)
    serve_off(priced, 32, 300, turnover_every=0)  # calibrated, off
    serve_off(unpriced, 32, 300, turnover_every=0)
    assert serve_off(priced, 32, 4000, turnover_every=40) <= 0.035
    assert serve_off(unpriced, 32, 4000, turnover_every=40) > 0.06


def test_a_probe_that_nearly_pays_is_not_delayed() -> None:
    """Where a setting loses little (T(k) barely above λ(k) plain steps), the price allows
    probes as often as the backoff does."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    ctrl.prices = ProbePrices(0.03, ctrl.config.probe_steps)
    for _ in range(300):
        k = ctrl.choose_k(4, 256)
        ctrl.observe_step(k, 4, 0.01 * (1 + 0.75 * (BUDGETS[k] - 1)) if k else 0.01)
        ctrl.observe(k, [min(MAX_DRAFTS[k], 1)] * 4)  # budget 2: 1.7x time for 2 tokens
    assert ctrl._priced_wait <= ctrl.config.explore_every


def test_the_environment_sets_the_served_budget(monkeypatch) -> None:
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert served_budget() == 0.0
    monkeypatch.setenv(BUDGET_ENV, "0.03")
    assert served_budget() == pytest.approx(0.03)
    for bad in ("x", "1.5", "-1"):
        monkeypatch.setenv(BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=BUDGET_ENV):
            served_budget()


def test_a_switch_left_out_of_a_step_counts_in_its_probe() -> None:
    """Seconds a probe's step spent switching on (SPECBLOCK's drafter reading what it skipped
    while off: left out of the step's time) count in the probe's realised loss, once; outside a
    probe they price nothing."""
    prices = ProbePrices(budget=0.05, steps=2)
    prices.switched(1.0)  # no probe open: nothing to charge
    prices.opened(3)
    prices.switched(0.3)
    prices.observed(3, 16, seconds=0.02, t0=0.01, lam=2.0)  # (0.02 + 0.3) / 0.01 - 2 = 30
    assert prices.loss(16, 0.5, 2.0, True) == pytest.approx(30.0)
    prices.observed(3, 16, seconds=0.02, t0=0.01, lam=2.0)  # 0 lost: the switch is not repeated
    assert prices.loss(16, 0.5, 2.0, True) == pytest.approx(30.0 * 0.75)
    assert prices.wait(16, 0.5, 2.0, True) == 900  # 2 x 22.5 / 0.05


def _off_and_priced(bs: int) -> SpeculationController:
    """A SPECBLOCK controller calibrated and off at ``bs`` requests, its probes priced at a
    loss of 20 plain steps a probe step (a switch that reads a whole batch's tokens)."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    serve_off(ctrl, bs, 300, turnover_every=0)
    ctrl.prices._realised[batch_bucket(bs)] = 20.0
    return ctrl


def test_a_new_request_alone_is_probed_whatever_the_price() -> None:
    """Half a batch turning over does not bring a costly probe forward, nor does a wave of
    requests all new at once (it accepts like the population; its switch reads every prompt);
    a batch of one new request (each request at concurrency 1) is probed within
    ``TURNOVER_PROBE_STEPS`` + 1 steps: nothing is known of it."""
    ctrl = _off_and_priced(16)
    ctrl.batch_changed(8, 16)
    assert [ctrl.choose_k(16, 256) for _ in range(40)] == [0] * 40
    ctrl = _off_and_priced(16)
    ctrl.batch_changed(16, 16)
    assert [ctrl.choose_k(16, 256) for _ in range(40)] == [0] * 40
    # At one request, where a budget could pay at full acceptance (n nodes cost 1 + n/8 plain
    # steps) but the requests so far accepted nothing.
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    for _ in range(300):
        k = ctrl.choose_k(1, 256)
        ctrl.observe_step(k, 1, 0.01 * (1 + BUDGETS[k] / 8) if k else 0.01)
        ctrl.observe(k, [0])
    ctrl.prices._realised[batch_bucket(1)] = 20.0
    assert ctrl.choose_k(1, 256) == 0
    ctrl.batch_changed(1, 1)
    assert any(ctrl.choose_k(1, 256) for _ in range(TURNOVER_PROBE_STEPS + 1))


def test_a_setting_not_measured_yet_is_probed_until_measured_and_priced() -> None:
    """A budget not measured at this batch size is probed until its time is measured (one
    probe, not one every 16 steps of two steps each, each with its switch) or until what it
    measured shows the budget cannot pay at a plausible acceptance, and its probe is priced
    from its bound: at 16 requests where nothing pays, a fresh controller drafts on 6 of
    600 steps (calibrating budget 2, then measuring budget 8; with samples of one step each,
    ``StepTimes.provisional`` never ends SPECBLOCK's probes early)."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    decide, chosen, counts = ctrl.decide, [], []

    def recording(batch_size: int, ctx_len: int):
        # samples per budget of the steps before this decision (each step observed at once)
        counts.append([ctrl.times.count(batch_size, k) for k in range(len(BUDGETS))])
        decision = decide(batch_size, ctx_len)
        chosen.append(decision)
        return decision

    ctrl.decide = recording  # type: ignore[method-assign]
    serve_off(ctrl, 16, 600, turnover_every=0)
    drafted = [i for i, d in enumerate(chosen) if d.k]
    assert len(drafted) <= 6
    for i in drafted:  # each probe of an unmeasured budget ends measured or ruled out
        k = chosen[i].k
        if chosen[i].source == "bound" and i + 1 < len(chosen) and chosen[i + 1].k != k:
            measured = counts[i + 1][k] >= ctrl.times.min_samples
            ruled_out = not ctrl.could_pay(ctrl.predict(k, 16, 256), 16)
            assert measured or ruled_out
