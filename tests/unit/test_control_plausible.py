"""sgl_spec.control.controller: ``plausible_probes``. While off, a setting is probed only if it
could pay at the acceptance a batch of this size plausibly has (the population's plus two
standard deviations of a mean of that many requests, measured or the largest possible, or
one request's full range over the batch size, whichever is larger): at a large batch where
every setting loses at any such acceptance, probes stop (the wait keeps doubling, turnovers
included, and at the longest wait the best setting is probed all the same); a batch of one
request is probed as before, and a setting that could pay still is."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sgl_spec.control.budget import budget_controller
from sgl_spec.control.chain_steps import steps_controller
from sgl_spec.control.controller import IMPLAUSIBLE_WAIT, SpeculationController

BUDGETS = (1, 2, 4, 8)
MAX_DRAFTS = (0, 1, 3, 7)


def serve(ctrl: SpeculationController, bs: int, steps: int, cost, turnover_every: int = 0):
    """``steps`` steps at ``bs`` requests, setting k costing ``cost(k)`` plain steps of 10 ms,
    every request accepting one draft; half the batch new every ``turnover_every`` steps.
    Returns the settings run, in order."""
    ks = []
    for step in range(steps):
        if turnover_every and step and step % turnover_every == 0:
            ctrl.batch_changed(bs // 2, bs)
        k = ctrl.choose_k(bs, 256)
        ctrl.observe_step(k, bs, 0.01 * cost(k))
        ctrl.observe(k, [min(1, ctrl.acceptance.most_accepted(k))] * bs)
        ks.append(k)
    return ks


def test_plausible_length_spans_one_request_and_narrows_with_the_batch() -> None:
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    ctrl.acceptance.estimates[3] = 2.0  # budget 8: 2 drafts a request on average, 7 at most
    assert ctrl.plausible_length(3, 1) == 8.0  # one request may accept anything
    assert ctrl.plausible_length(3, 16) == pytest.approx(3.0 + 7 / 4)
    assert ctrl.plausible_length(3, 64) == pytest.approx(3.0 + 7 / 8)
    chain = steps_controller(3)
    chain.acceptance.population = [0.5, 0.5, 0.5]
    assert chain.plausible_length(2, 4) == pytest.approx(1.75 + 2 / 2)
    assert chain.plausible_length(1, 1) == 2.0


def test_a_measured_spread_narrows_the_plausible_length() -> None:
    """Budget 8 accepting 1 or 3 drafts a request (standard deviation 1, measured over 16
    steps) at 16 requests: two deviations of the mean are 0.5, not the 1.75 of the largest
    possible spread; at one request the full range stays; one request accepting all 7 drafts
    bounds it from below (7 / 16 at 16 requests)."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    for _ in range(15):
        ctrl.observe(3, [1, 3] * 8)
    assert ctrl.acceptance.spread(3) is None  # too few steps: the largest possible spread
    assert ctrl.plausible_length(3, 16) == pytest.approx(3.0 + 7 / 4)
    ctrl.observe(3, [1, 3] * 8)
    assert ctrl.acceptance.spread(3) == pytest.approx(1.0)
    assert ctrl.plausible_length(3, 16) == pytest.approx(3.0 + 0.5)
    assert ctrl.plausible_length(3, 1) == 8.0
    for _ in range(200):
        ctrl.observe(3, [2] * 16)  # every request alike: the one-outlier term remains
    assert ctrl.plausible_length(3, 16) == pytest.approx(3.0 + 7 / 16, abs=0.05)


def test_no_probes_at_a_large_batch_where_nothing_could_pay() -> None:
    """Budget n costs 1 + n plain steps at 32 requests: at ~2 accepted tokens a request none
    comes near paying; calibrated once, the settings are then probed only at the longest
    wait, turnovers every 40 steps included (without the rule: every turnover)."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    off = replace(ctrl.config, plausible_probes=False)
    before = budget_controller(BUDGETS, MAX_DRAFTS)
    before.config = off
    for c in (ctrl, before):
        serve(c, 32, 300, lambda k: 1 + BUDGETS[k] if k else 1)
    cost = lambda k: 1 + BUDGETS[k] if k else 1  # noqa: E731
    probed = sum(k > 0 for k in serve(ctrl, 32, 4000, cost, turnover_every=40))
    probed_before = sum(k > 0 for k in serve(before, 32, 4000, cost, turnover_every=40))
    assert 0 < probed <= (4000 // IMPLAUSIBLE_WAIT + 1) * 4
    assert probed_before > 3 * probed


def test_a_setting_that_could_pay_is_still_probed() -> None:
    """At 4 requests budget 2 costs 1.1 plain steps: it pays at 1.25 tokens a request, which a
    batch plausibly reaches if one new request accepts its draft while the others accept none
    (every request measured so far accepted alike: no measured spread), so turnovers still
    probe it, as without the rule."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    cost = lambda k: 1.1 if k == 1 else (1 + BUDGETS[k] if k else 1)  # noqa: E731
    serve(ctrl, 4, 300, cost)
    ctrl.acceptance.estimates[1] = 0.0  # the batch now accepts nothing: off
    ks = serve(ctrl, 4, 600, cost, turnover_every=40)
    assert sum(k > 0 for k in ks) >= 600 // 40


def test_one_request_is_probed_where_many_are_not() -> None:
    """A chain whose drafts are all rejected, k costing 1 + k/2 plain steps: at one request a
    new request may accept every draft (λ(1) up to 2, τ(1) 2/3: it could pay), so each new one
    is probed; at 16 requests the batch plausibly accepts near the population's nothing, so
    turnovers probe nothing until the longest wait."""
    cost = lambda k: 1 + k / 2  # noqa: E731
    probes = {}
    for bs in (1, 16):
        ctrl = steps_controller(3)
        serve(ctrl, bs, 200, cost)
        ctrl.acceptance.alphas = [0.0] * 3
        ctrl.acceptance.population = [0.0] * 3
        ctrl.acceptance.seen = [1000] * 3
        ks = []
        for step in range(1, 801):
            if step % 40 == 0:  # a new request for each of the batch's
                ctrl.batch_changed(bs, bs)
            k = ctrl.choose_k(bs, 256)
            ctrl.observe_step(k, bs, 0.01 * cost(k))
            ctrl.observe(k, [0] * bs)
            ks.append(k)
        probes[bs] = sum(k > 0 for k in ks)
    assert probes[1] >= 800 // 40 - 1
    assert probes[16] <= 800 // IMPLAUSIBLE_WAIT * 4 + 4
