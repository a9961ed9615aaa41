"""sgl_spec.control over node budgets where one request's acceptance is noisy: the budgets'
ratios learnt on the steps that observed both, a step's weight per request it observed, a
probe while off re-measuring, and the served controller staying on at one request where the
largest budget pays although single steps accept anything from 0 to 4 drafts."""

from __future__ import annotations

import bisect
import itertools
import json
import random
from pathlib import Path

import pytest

from sgl_spec.control.acceptance import BudgetAcceptance
from sgl_spec.control.budget import REQUEST_WEIGHT, budget_controller

BUDGETS = (1, 2, 4, 8)
MAX_DRAFTS = (0, 1, 3, 7)
PRIOR = [0.0, 0.7, 1.5, 2.0]


def test_a_larger_budget_follows_by_the_ratio_learnt_on_shared_steps() -> None:
    """Steps at budget 8 also observe budgets 2 and 4 (its tree's best nodes): budget 8
    accepted twice budget 4's there, so while budget 4 runs alone budget 8 is expected to
    accept twice what budget 4 now does -- not what the smaller budget's own movement says."""
    model = BudgetAcceptance(MAX_DRAFTS, PRIOR, weight=0.5)
    for _ in range(4):
        model.observe_settings({1: [1], 2: [2], 3: [4]})
    assert model.ratio(3, 2) == pytest.approx(2.0)
    assert model.ratio(2, 1) == pytest.approx(2.0)
    model.observe_settings({1: [1], 2: [0]})  # budget 4 runs: a step that accepts nothing
    assert model.estimates[2] == pytest.approx(1.0)  # EWMA 0.5 from 2
    assert model.estimates[3] == pytest.approx(2.0)  # its ratio to budget 4
    assert model.estimates[1] == pytest.approx(1.0)  # observed: its own EWMA
    model.observe_settings({1: [1], 2: [3]})
    assert model.estimates[3] == pytest.approx(4.0)
    model.observe_settings({1: [1], 2: [3], 3: [6]})  # budget 8 observed: the ratio moves
    assert model.ratio(3, 2) == pytest.approx(2.0)  # slowly: 6 / 3 is the same
    assert model.estimates[3] == pytest.approx(5.0)  # its own EWMA now


def test_ratios_move_slowly_and_without_shared_steps_the_factor_rules() -> None:
    model = BudgetAcceptance(MAX_DRAFTS, PRIOR, weight=0.5)
    model.observe_settings({1: [1], 2: [2], 3: [4]})
    for _ in range(30):  # 30 steps where budget 8 accepts no more than budget 4
        model.observe_settings({1: [1], 2: [2], 3: [2]})
    assert 1.0 < model.ratio(3, 2) < 1.5  # moving toward 1, not there after 30 steps
    assert model.ratio(2, 1) == pytest.approx(2.0)
    fresh = BudgetAcceptance(MAX_DRAFTS, PRIOR, weight=0.5)
    assert fresh.ratio(3, 2) is None
    fresh.observe(3, [2])
    fresh.observe(3, [2])
    fresh.observe(2, [2])
    fresh.observe(2, [1])  # no step observed 4 and 8 together: 8 follows 4's factor
    assert fresh.estimates[3] == pytest.approx(1.5)


def test_a_steps_weight_grows_with_the_requests_it_observed() -> None:
    model = BudgetAcceptance(MAX_DRAFTS, PRIOR, weight=0.25, request_weight=0.1)
    assert model.step_weight(1) == pytest.approx(0.1)
    assert model.step_weight(2) == pytest.approx(0.2)
    assert model.step_weight(16) == pytest.approx(0.25)
    for _ in range(20):
        model.observe(3, [2])
    model.observe(3, [0])  # one request's unlucky step moves the estimate a tenth of the way
    assert model.estimates[3] == pytest.approx(1.8)
    model.observe(3, [0, 0, 0, 0])  # four requests' a quarter
    assert model.estimates[3] == pytest.approx(1.35)
    assert BudgetAcceptance(MAX_DRAFTS, PRIOR, weight=0.25).step_weight(1) == 0.25


def test_a_probe_while_off_re_measures() -> None:
    """Estimates left low by the steps that turned drafting off are as old as those steps: a
    probe's first observation averages with each as with one observation."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    model = ctrl.acceptance
    for _ in range(50):
        model.observe_settings({1: [0], 2: [0], 3: [0]})
    model.reopen()
    model.observe_settings({1: [1], 2: [3], 3: [4]})
    assert model.estimates[1:] == pytest.approx([0.5, 1.5, 2.0])
    model.observe_settings({1: [1], 2: [3], 3: [4]})  # a third of the way, then the EWMA
    assert model.estimates[3] == pytest.approx(2.0 + (4 - 2.0) / 3)


TRACE = Path(__file__).parent / "data" / "specblock_trace_random_c1.json"


def _replay(ctrl, rounds: int, seed: int) -> tuple[float, float]:
    """Tokens per second of ``ctrl`` (None: 8 nodes every step) and its share of steps off,
    serving the trace's requests one at a time: a step at token position p of a request
    accepts what the trace's first step at or after p accepted at that budget (a step without
    drafts commits one token), taking the trace's step time per budget, +-10%."""
    trace = json.loads(TRACE.read_text())
    times = {int(n): s for n, s in trace["step_seconds"].items()}
    rng = random.Random(seed)
    tokens = seconds = off = steps = 0
    for _ in range(rounds):
        for request in trace["requests"]:
            counts = [(0, *map(int, step)) for step in request.split()]
            starts = list(itertools.accumulate((1 + c[3] for c in counts), initial=0))
            if ctrl is not None:
                ctrl.batch_changed(1, 1)
            position = 0
            while position < starts[-1]:
                k = 3 if ctrl is None else ctrl.choose_k(1, 128 + position)
                at = counts[min(bisect.bisect_left(starts, position), len(counts) - 1)]
                accepted = min(at[k], starts[-1] - position - 1)
                t = times[BUDGETS[k]] * rng.uniform(0.9, 1.1)
                if ctrl is not None:
                    ctrl.observe_step(k, 1, t)
                    if k:
                        seen = {j: [min(at[j], accepted)] for j in range(1, k)}
                        ctrl.observe_settings({**seen, k: [accepted]})
                position += 1 + accepted
                tokens, seconds = tokens + 1 + accepted, seconds + t
                off, steps = off + (k == 0), steps + 1
    return tokens / seconds, off / steps


@pytest.mark.parametrize("seed", [0, 1])
def test_one_noisy_request_keeps_drafting_where_it_pays(seed: int) -> None:
    """A served trace at one request where 8 nodes pay 1.6x although single steps accept
    anything from 0 to 4 drafts (mean 2.2, standard deviation 1.5). With a step weight of 0.25
    whatever the batch, and budget 8 following budget 2's movement, a few unlucky steps turned
    drafting off for 16 steps or more at a time (0.75-0.81x the fixed budget, 67-76% of
    the steps off, seeds 0-2); now within 10% of 8 nodes every step."""
    fixed, _ = _replay(None, 2, seed)
    auto, off = _replay(budget_controller(BUDGETS, MAX_DRAFTS), 2, seed)
    assert REQUEST_WEIGHT < 0.25
    assert auto >= 0.9 * fixed
    assert off < 0.3
