"""sgl_spec.control over node budgets (SPECBLOCK's ``--specblock-budget auto``): the
per-budget acceptance model, the budgets a launch offers, and the served controller choosing
a budget from simulated step times and acceptance, following a load change both ways."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from sgl_spec.control.acceptance import BudgetAcceptance, ChainAcceptance
from sgl_spec.control.budget import budget_controller
from sgl_spec.control.controller import (
    TURNOVER_PROBE_STEPS,
    ControllerConfig,
    SpeculationController,
)
from sgl_spec.control.cost_model import BudgetCost
from sgl_spec.control.step_times import StepClock
from sgl_spec.specblock.drafting import DraftSettings
from sgl_spec.specblock.settings import SpecBlockSettings

BUDGETS = (1, 2, 4, 8)
MAX_DRAFTS = (0, 1, 3, 7)


def test_budget_acceptance_averages_first_then_follows_as_an_ewma() -> None:
    model = BudgetAcceptance(MAX_DRAFTS, [0.0, 0.7, 1.5, 2.0], weight=0.25)
    assert [model.length(k) for k in range(4)] == pytest.approx([1.0, 1.7, 2.5, 3.0])
    model.observe(2, [0, 0])  # the first observation replaces the prior
    assert model.estimates[2] == 0.0
    model.observe(2, [2, 2])  # the second: the mean of the two
    assert model.estimates[2] == pytest.approx(1.0)
    for _ in range(3):
        model.observe(2, [1])
    model.observe(2, [3])  # fifth: 1/5 < the weight, so the EWMA weight applies
    assert model.estimates[2] == pytest.approx(1.0 + 0.25 * (3 - 1.0))
    model.observe(0, [0, 0])  # a step without drafts says nothing
    assert model.num_observed[0] == 0


def test_a_change_seen_at_one_budget_moves_the_others() -> None:
    model = BudgetAcceptance(MAX_DRAFTS, [0.0, 0.7, 1.5, 2.0], weight=0.5)
    model.observe(3, [2])
    model.observe(2, [2])  # first observations only replace their priors
    assert model.estimates == [0.0, 0.7, 2.0, 2.0]
    model.observe(2, [1])  # budget 4 falls by a quarter: budget 8 follows, budget 2 (never
    assert model.estimates == pytest.approx([0.0, 0.7, 1.5, 1.5])  # observed) keeps its prior


def test_budgets_observed_on_one_step_move_together_and_lead_the_rest() -> None:
    model = BudgetAcceptance(MAX_DRAFTS, [0.0, 0.7, 1.5, 2.0], weight=0.5)
    model.observe_settings({2: [2], 3: [4]})
    model.observe_settings({2: [2], 3: [4]})  # first observations: averages, no factor
    assert model.estimates == [0.0, 0.7, 2.0, 4.0]
    assert model.num_observed == [0, 0, 2, 2]
    model.observe(1, [1])  # budget 2 enters
    model.observe_settings({1: [1], 2: [1]})  # budget 8 (not observed) follows budget 4 down
    assert model.estimates == pytest.approx([0.0, 1.0, 1.5, 3.0])
    model.observe_settings({1: [0], 2: [0], 3: [2]})  # all observed: each its own EWMA
    assert model.estimates == pytest.approx([0.0, 0.5, 0.75, 2.5])
    model.observe_settings({})  # nothing observed: nothing moves
    model.observe_settings({0: [0]})
    assert model.estimates == pytest.approx([0.0, 0.5, 0.75, 2.5])


def test_controller_checks_every_observed_setting() -> None:
    controller = budget_controller(BUDGETS, MAX_DRAFTS)
    controller.observe_settings({1: [1, 0], 3: [7, 2]})
    assert controller.acceptance.num_observed == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="lie in"):
        controller.observe_settings({1: [2], 3: [2]})  # budget 2 accepts one draft at most
    with pytest.raises(ValueError, match="k_used"):
        controller.observe_settings({4: [0]})
    chain = SpeculationController(
        None, BudgetCost(BUDGETS), ControllerConfig(k_max=3, calibrate_steps=1)
    )
    with pytest.raises(TypeError, match="one setting per step"):
        chain.observe_settings({1: [1]})


def test_budget_acceptance_is_monotone_in_the_budget() -> None:
    model = BudgetAcceptance(MAX_DRAFTS, [0.0, 0.9, 2.0, 3.0], weight=0.1)
    model.observe(3, [0])  # an unlucky step at the largest budget
    assert model.length(3) == pytest.approx(3.0)  # still keeps budget 4's expectation
    assert model.most_accepted(3) == 7


@pytest.mark.parametrize(
    ("max_drafts", "prior"),
    [((1, 3), (0.0, 1.0)), ((0, 3), (0.0,)), ((0, 1), (0.0, 2.0)), ((), ())],
)
def test_budget_acceptance_refuses_bad_shapes(max_drafts, prior) -> None:
    with pytest.raises(ValueError):
        BudgetAcceptance(max_drafts, prior, weight=0.1)


def test_budget_cost_needs_budgets_rising_from_one() -> None:
    assert BudgetCost(BUDGETS).tokens_per_step(3) == 8
    for bad in ((), (2, 4), (1, 4, 2), (1, 1, 2)):
        with pytest.raises(ValueError):
            BudgetCost(bad)


class _DraftsAtZero(ChainAcceptance):
    def most_accepted(self, k: int) -> int:
        return k + 1


def test_controller_refuses_a_setting_zero_with_drafts() -> None:
    config = budget_controller((1, 2), (0, 1)).config
    with pytest.raises(ValueError, match="k = 0"):
        SpeculationController(None, BudgetCost((1, 2)), config, _DraftsAtZero([0.5], 0.1))


@pytest.mark.parametrize(
    ("max_nodes", "num_blocks", "budgets", "drafts"),
    [
        (8, 2, (1, 2, 4, 8), (0, 1, 3, 7)),
        (5, 2, (1, 2, 4, 5), (0, 1, 3, 4)),
        (2, 2, (1, 2), (0, 1)),
        (32, 1, (1, 2, 4, 8, 16, 32), (0, 1, 3, 4, 4, 4)),  # depth M*K = 4 bounds the path
    ],
)
def test_specblock_budgets(max_nodes, num_blocks, budgets, drafts) -> None:
    draft = DraftSettings(num_blocks=num_blocks, max_nodes=max_nodes)
    settings = SpecBlockSettings("d", None, 4, draft, budget="auto")  # K = 4
    assert settings.budgets() == budgets
    assert settings.budget_drafts() == drafts


# --- the served controller on a simulated host ----------------------------------------------


# Mean accepted drafts per request under each budget: diminishing returns, as real trees give.
GOOD = (0.0, 0.7, 1.5, 2.1)
NOTHING = (0.0, 0.0, 0.0, 0.0)


def serve(ctrl, bs: int, steps: int, node_cost: float, accepted=GOOD) -> Counter:
    """``steps`` served steps of ``bs`` requests: a step of budget n costs 1 + node_cost·n·bs
    (ms), and its requests accept ``accepted[k]`` drafts on average (whole counts whose
    running mean is exactly that)."""
    chosen: Counter = Counter()
    carry = 0.0
    for _ in range(steps):
        k = ctrl.choose_k(bs, 256)
        chosen[BUDGETS[k]] += 1
        ctrl.observe_step(k, bs, 0.001 * (1 + node_cost * BUDGETS[k] * bs))
        counts = []
        for _ in range(bs):
            carry += accepted[k]
            counts.append(int(carry))
            carry -= int(carry)
        ctrl.observe(k, counts)
    return chosen


def test_budget_controller_picks_the_budget_of_most_tokens_per_second() -> None:
    # bs 4, a node costs 0.05 ms a request: tokens per ms 0.83, 1.21, 1.39, 1.19 for 1..8 nodes
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    chosen = serve(ctrl, 4, 600, node_cost=0.05)
    assert chosen[4] > 0.8 * 600
    assert 0 < chosen[2] + chosen[8] < 0.15 * 600  # the others are probed now and then


def test_budget_controller_turns_drafting_off_where_nothing_is_accepted() -> None:
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    chosen = serve(ctrl, 4, 600, node_cost=0.05, accepted=NOTHING)
    assert chosen[1] > 0.9 * 600


def test_budget_controller_follows_a_load_step_both_ways() -> None:
    """bs 1 where 8 nodes pay (tokens per ms 0.95, 1.55, 2.08, 2.21), then bs 32 where no
    draft pays (0.238, 0.230, 0.181, 0.117: a node costs 0.1 ms a request), then bs 1 again:
    the choice follows each way within the calibration of the new batch-size bucket."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    assert serve(ctrl, 1, 400, node_cost=0.05)[8] > 0.8 * 400
    busy = serve(ctrl, 32, 400, node_cost=0.1)
    assert busy[1] > 0.85 * 400
    late = serve(ctrl, 1, 100, node_cost=0.05)
    assert late[8] > 0.85 * 100  # back on the bs-1 bucket's measured best


def test_the_default_acceptance_model_is_a_chains() -> None:
    ctrl = SpeculationController(None, BudgetCost((1, 2)), budget_controller((1, 2), (0, 1)).config)
    assert isinstance(ctrl.acceptance, ChainAcceptance)
    assert ctrl.alphas == [0.7]


def test_step_clock_measures_start_to_start_of_the_same_requests() -> None:
    clock = StepClock()
    assert clock.last_key is None
    assert clock.tick(("a", "b"), 1.0) is None  # nothing before
    assert clock.last_key == ("a", "b")
    clock.chosen(2, 2)
    assert clock.tick(("a", "b"), 1.5) == (2, 2, 0.5)
    clock.chosen(0, 2)
    assert clock.tick(("a", "b", "c"), 2.0) is None  # a request joined: a prefill ran between
    clock.chosen(1, 3)
    assert clock.tick(("a", "b", "c"), 2.25) == (1, 3, 0.25)
    # a step whose setting was never reported (no controller decision) is not measured
    assert clock.tick(("a", "b", "c"), 3.0) is None
    clock.chosen(0, 3)
    assert clock.tick(("b", "c"), 3.5) is None  # a request finished: another batch shape
    clock.chosen(2, 2)
    clock.exclude(0.25)  # one-off work of that step (a drafter catching up) is left out
    assert clock.tick(("b", "c"), 4.0) == (2, 2, 0.25)


def test_speculating_budget_controller_runs_few_plain_steps() -> None:
    """Off, it probes every 16 steps; on, T(0) is refreshed only every 256 steps."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    serve(ctrl, 4, 200, node_cost=0.05)  # calibrated, speculating at budget 4
    assert serve(ctrl, 4, 500, node_cost=0.05)[1] <= 3


def test_a_new_request_at_one_request_is_probed_at_once() -> None:
    """At bs 1, a request that accepts nothing turns drafting off and, probe after probe, the
    wait between probes grows; the next request (the batch turned over) is probed within
    ``TURNOVER_PROBE_STEPS`` + 1 steps and drafts if it accepts."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    serve(ctrl, 1, 200, node_cost=0.05)  # calibrated
    assert serve(ctrl, 1, 600, node_cost=0.05, accepted=NOTHING)[1] > 0.9 * 600
    assert ctrl._backoff > 1
    ctrl.batch_changed(1, 1)
    soon = serve(ctrl, 1, TURNOVER_PROBE_STEPS + 1, node_cost=0.05)
    assert soon[1] <= TURNOVER_PROBE_STEPS  # the probe drafts
    assert serve(ctrl, 1, 100, node_cost=0.05)[8] > 0.8 * 100  # and stays on


def test_a_few_joins_in_a_large_batch_do_not_bring_probes_forward() -> None:
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    serve(ctrl, 32, 300, node_cost=0.1)  # calibrated, off
    waits = ctrl.num_steps_off, ctrl._backoff
    for _ in range(15):  # 15 of 32 new: less than half the batch
        ctrl.batch_changed(1, 32)
    assert (ctrl.num_steps_off, ctrl._backoff) == waits
    ctrl.batch_changed(1, 32)  # the 16th: half the batch is new
    assert ctrl._backoff == 1 and ctrl.num_steps_off >= ctrl.config.explore_every - 2
    mtp_like = SpeculationController(
        None, BudgetCost(BUDGETS), replace(ctrl.config, probe_on_turnover=False)
    )
    mtp_like.batch_changed(32, 32)
    assert mtp_like.num_steps_off == 0 and mtp_like._joined == 0


def test_a_batch_halved_since_the_last_probe_is_probed_again() -> None:
    """Load falling (requests leaving, none joining): each halving of the batch since the last
    probe brings the next probe forward, so the last request alone is probed at once."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    serve(ctrl, 1, 200, node_cost=0.05)  # bs 1 calibrated (drafting pays there)
    serve(ctrl, 32, 300, node_cost=0.1)  # off, probed now and then at bs 32
    assert ctrl._probed_batch_size == 32 and ctrl._backoff > 1
    ctrl.batch_changed(0, 20)  # not yet half
    assert ctrl._backoff > 1
    ctrl.batch_changed(0, 16)
    assert ctrl._backoff == 1 and ctrl.num_steps_off >= ctrl.config.explore_every - 2
    serve(ctrl, 16, 3, node_cost=0.1)  # the probe runs at bs 16
    assert ctrl._probed_batch_size == 16
    ctrl.batch_changed(0, 1)
    assert serve(ctrl, 1, TURNOVER_PROBE_STEPS + 1, node_cost=0.05)[1] <= TURNOVER_PROBE_STEPS


def test_step_clock_across_changes_measures_up_to_any_step_of_the_same_requests() -> None:
    """``across_changes``: a join or a departure between two decode steps is charged to the
    first (the prefill ran on its time); a next step of none of its requests (an idle server,
    a client's round trip) is never measured."""
    clock = StepClock()
    clock.tick(("a", "b"), 1.0, across_changes=True)
    clock.chosen(3, 2)
    assert clock.tick(("a", "b", "c"), 1.5, across_changes=True) == (3, 2, 0.5)
    clock.chosen(0, 3)
    assert clock.tick(("b", "c"), 1.75, across_changes=True) == (0, 3, 0.25)
    clock.chosen(2, 2)
    assert clock.tick(("d",), 9.0, across_changes=True) is None


def test_step_clock_tells_the_controller_who_joined_even_when_it_measures() -> None:
    class Recorder:
        config = ControllerConfig(time_batch_changes=True)

        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def observe_step(self, *args: object, steady: bool) -> None:
            self.calls.append(("step", *args))

        def batch_changed(self, joined: int, batch_size: int) -> None:
            self.calls.append(("changed", joined, batch_size))

    clock, recorder = StepClock(), Recorder()
    clock.start(("a",), 1.0, recorder)
    clock.chosen(1, 1)
    clock.start(("a", "b"), 2.0, recorder)
    assert recorder.calls == [("step", 1, 1, 1.0), ("changed", 1, 2)]
