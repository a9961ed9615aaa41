"""sgl_spec.control.controller and its cost model: equation 1, the τ table, step times, and the k
chosen from τ and acceptance."""

from __future__ import annotations

import json
import math

import pytest

from sgl_spec.control.controller import ControllerConfig, SpeculationController
from sgl_spec.control.cost_model import (
    DrafterCost,
    GammaTable,
    MTPGatedLoRACost,
    predicted_speedup,
)
from sgl_spec.control.step_times import StepTimes, batch_bucket

BATCH_SIZES = (1, 16, 128)
CTX_LENS = (128, 1024)
GAMMAS = (1, 2, 4, 8, 16, 25)


def table_of(tau_fn, gammas=GAMMAS) -> GammaTable:
    points = [
        {"batch_size": b, "ctx_len": c, "gamma": g, "tau": tau_fn(b, c, g)}
        for b in BATCH_SIZES
        for c in CTX_LENS
        for g in gammas
    ]
    return GammaTable.from_points(points)


COMPUTE_BOUND = table_of(lambda b, c, g: 1.0 / g)
MEMORY_BOUND = table_of(lambda b, c, g: 1.0)
# τ = γ^-1/4: MTP's S(k) = λ(k) / sqrt(k+1).
MODERATE = table_of(lambda b, c, g: g**-0.25)


def controller(table: GammaTable, cost=None, **config) -> SpeculationController:
    return SpeculationController(table, cost or MTPGatedLoRACost(), ControllerConfig(**config))


# --- equation 1 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lam", "tau", "gamma", "delta", "expected"),
    [
        (3.0, 0.81, 4, 0.0, 2.43),  # §3.2: τ(5)=0.81, λ≈3 -> 2.43x
        (3.0, 0.34, 24, 0.0, 1.02),  # §4.1: τ(25)=0.34 -> break-even
        (2.0, 0.5, 3, 0.2, 1.0 / 1.3),  # 2·0.5 / (1 + 3·0.2·0.5)
        (2.5, 1.0, 4, 0.5, 2.5 / 3.0),  # τ≈1: λ / (1 + γδ)
        (1.0, 1.0, 0, 0.7, 1.0),  # no drafts: S = 1
    ],
)
def test_equation_1_matches_hand_computed(lam, tau, gamma, delta, expected) -> None:
    assert predicted_speedup(lam, tau, gamma, delta) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "args", [(0.9, 1.0, 1, 0.0), (2.0, 0.0, 1, 0.0), (2.0, 1.0, -1, 0.0), (2.0, 1.0, 1, -0.1)]
)
def test_equation_1_rejects_out_of_domain(args) -> None:
    with pytest.raises(ValueError):
        predicted_speedup(*args)


# --- GammaTable -----------------------------------------------------------------------------


def test_table_is_exact_at_measured_points() -> None:
    table = table_of(lambda b, c, g: 1.0 / (1 + 0.01 * b * g) + c * 1e-5)
    for b in BATCH_SIZES:
        for c in CTX_LENS:
            for g in GAMMAS:
                assert table.tau(b, c, g) == pytest.approx(1.0 / (1 + 0.01 * b * g) + c * 1e-5)


def test_table_interpolates_linearly_in_log_coordinates() -> None:
    points = [
        {"batch_size": b, "ctx_len": c, "gamma": g, "tau": tau}
        for (b, c, g), tau in {
            (1, 100, 1): 1.0, (1, 100, 4): 0.6, (16, 100, 1): 1.0, (16, 100, 4): 0.2,
            (1, 400, 1): 1.0, (1, 400, 4): 0.8, (16, 400, 1): 1.0, (16, 400, 4): 0.4,
        }.items()
    ]  # fmt: skip
    table = GammaTable.from_points(points)
    # γ=2, bs=4, ctx=200 are the log-midpoints of their axes.
    assert table.tau(1, 100, 2) == pytest.approx(0.8)
    assert table.tau(4, 100, 4) == pytest.approx(0.4)
    assert table.tau(1, 200, 4) == pytest.approx(0.7)
    assert table.tau(4, 200, 2) == pytest.approx((1.0 + (0.6 + 0.2 + 0.8 + 0.4) / 4) / 2)
    # a quarter of the way in log space along γ: 4^(1/4) = sqrt(2)
    assert table.tau(1, 100, math.sqrt(2)) == pytest.approx(1.0 - 0.25 * 0.4)


def test_table_clamps_outside_the_grid() -> None:
    table = table_of(lambda b, c, g: 1.0 / (1 + 0.01 * b * g) * (1 + c * 1e-4))
    assert table.tau(0.5, 128, 4) == table.tau(1, 128, 4)
    assert table.tau(4096, 128, 4) == table.tau(128, 128, 4)
    assert table.tau(16, 8, 4) == table.tau(16, 128, 4)
    assert table.tau(16, 100_000, 4) == table.tau(16, 1024, 4)
    assert table.tau(16, 128, 100) == table.tau(16, 128, 25)
    assert table.max_gamma == 25


def test_table_needs_a_full_valid_grid() -> None:
    points = [
        {"batch_size": 1, "ctx_len": 16, "gamma": 1, "tau": 1.0},
        {"batch_size": 1, "ctx_len": 16, "gamma": 2, "tau": 0.9},
        {"batch_size": 2, "ctx_len": 16, "gamma": 1, "tau": 1.0},
    ]
    with pytest.raises(ValueError, match="full grid"):
        GammaTable.from_points(points)
    points.append({"batch_size": 2, "ctx_len": 16, "gamma": 2, "tau": float("nan")})
    with pytest.raises(ValueError, match="positive and finite"):
        GammaTable.from_points(points)


def test_table_loads_the_benchmark_json(tmp_path) -> None:
    points = [
        {"batch_size": b, "ctx_len": 64, "gamma": g, "median_ms": 1.0 + g, "tau": 2.0 / (1 + g)}
        for b in (1, 4)
        for g in (1, 2, 4)
    ]
    path = tmp_path / "tau.json"
    path.write_text(json.dumps({"schema_version": 1, "points": points}))
    table = GammaTable.load(path)
    assert (table.batch_sizes, table.ctx_lens, table.gammas) == ((1, 4), (64,), (1, 2, 4))
    assert table.tau(4, 64, 2) == pytest.approx(2.0 / 3)
    path.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="points"):
        GammaTable.load(path)


# --- cost models ----------------------------------------------------------------------------


def test_step_costs() -> None:
    assert [MTPGatedLoRACost().tokens_per_step(k) for k in range(5)] == [1, 4, 9, 16, 25]
    assert MTPGatedLoRACost().delta == 0.0
    assert [DrafterCost(0.3).tokens_per_step(k) for k in range(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="delta"):
        DrafterCost(-0.1)


# --- choosing k -----------------------------------------------------------------------------


def test_acceptance_length_from_per_position_alphas() -> None:
    ctrl = controller(MEMORY_BOUND, alpha_prior=(0.8, 0.5, 0.5, 0.0))
    lams = [ctrl.acceptance_length(k) for k in range(5)]
    assert lams == pytest.approx([1.0, 1.8, 2.2, 2.4, 2.4])


@pytest.mark.parametrize("cost", [MTPGatedLoRACost(), DrafterCost(0.0), DrafterCost(0.2)])
@pytest.mark.parametrize("bs", [1, 16, 128, 1000])
def test_compute_bound_turns_speculation_off(cost, bs: int) -> None:
    ctrl = controller(COMPUTE_BOUND, cost, alpha_prior=0.95, explore_every=0)
    decision = ctrl.decide(bs, 512)
    assert decision.k == 0
    assert (decision.predicted_speedup, decision.gamma, decision.tau) == (1.0, 1, 1.0)


def test_memory_bound_mtp_speculates_at_k_max() -> None:
    decision = controller(MEMORY_BOUND, alpha_prior=0.7).decide(16, 512)
    lam = 1 + 0.7 + 0.7**2 + 0.7**3 + 0.7**4
    assert (decision.k, decision.gamma, decision.tau) == (4, 25, 1.0)
    assert decision.predicted_speedup == pytest.approx(lam)
    assert decision.lam == pytest.approx(lam)


def test_memory_bound_drafter_balances_drafts_against_delta() -> None:
    # S(k) = λ(k)/(1 + 0.3k), α=0.8: 1.385, 1.525, 1.554, 1.528 -> k = 3
    ctrl = controller(MEMORY_BOUND, DrafterCost(0.3), alpha_prior=0.8)
    decision = ctrl.decide(16, 512)
    assert decision.k == 3
    assert decision.gamma == 4
    assert decision.predicted_speedup == pytest.approx(2.952 / 1.9)


def test_margin_keeps_a_marginal_gain_off() -> None:
    # MODERATE, MTP k=1: S = (1 + α)/sqrt(2); α = 0.43 gives S = 1.0112
    assert controller(MODERATE, alpha_prior=0.43, k_max=1, margin=0.0).choose_k(1, 128) == 1
    assert controller(MODERATE, alpha_prior=0.43, k_max=1, margin=0.02).choose_k(1, 128) == 0


def test_observe_updates_conditional_acceptance() -> None:
    ctrl = controller(MEMORY_BOUND, alpha_prior=0.5, ewma_weight=1.0)
    ctrl.observe(3, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never reached
    assert ctrl.alphas == [1.0, 0.0, 0.5, 0.5]
    ctrl.observe(2, [0, 2, 1, 2])  # draft 1: 3 of 4 accepted; draft 2: 2 of the 3 that reached it
    assert ctrl.alphas == pytest.approx([0.75, 2 / 3, 0.5, 0.5])
    ctrl.observe(0, [0, 0])
    assert ctrl.alphas == pytest.approx([0.75, 2 / 3, 0.5, 0.5])
    half = controller(MEMORY_BOUND, alpha_prior=0.5, ewma_weight=0.5)
    half.observe(1, 1)
    assert half.alphas[0] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="num_accepted_drafts"):
        ctrl.observe(2, 3)
    with pytest.raises(ValueError, match="k_used"):
        ctrl.observe(5, 0)


def test_rejections_then_acceptances_move_the_choice() -> None:
    ctrl = controller(MODERATE, alpha_prior=0.9, ewma_weight=0.1, explore_every=0)
    assert ctrl.choose_k(16, 512) == 4  # S = 4.095 / sqrt(5) = 1.83
    chosen = []
    for _ in range(60):
        k = ctrl.choose_k(16, 512)
        chosen.append(k)
        if k:
            ctrl.observe(k, [0] * 8)
    assert chosen[-1] == 0
    assert chosen == sorted(chosen, reverse=True)  # monotone as α only falls
    for _ in range(60):
        ctrl.observe(4, [4] * 8)
    assert ctrl.choose_k(16, 512) == 4


def test_larger_batch_with_steeper_tau_picks_fewer_drafts() -> None:
    # τ falls faster with γ as batch size grows (§3.2); acceptance is the same.
    table = table_of(lambda b, c, g: g ** (-0.05 * math.log2(b + 1)))
    ctrl = controller(table, alpha_prior=0.8)
    ks = [ctrl.choose_k(bs, 512) for bs in BATCH_SIZES]
    assert ks[0] == 4
    assert ks == sorted(ks, reverse=True)
    assert ks[-1] < ks[0]


def test_exploration_after_explore_every_steps_off() -> None:
    ctrl = controller(COMPUTE_BOUND, alpha_prior=0.9, explore_every=3)
    decisions = [ctrl.decide(16, 512) for _ in range(30)]
    probed = [i for i, d in enumerate(decisions) if d.k > 0]
    # after 3 steps off, then after 6, then 12: each probe that changes nothing doubles the wait
    assert probed == [3, 10, 23]
    explored = decisions[3]
    assert explored.explore
    assert explored.k == ctrl.best(16, 512, min_k=1).k
    assert explored.predicted_speedup < 1.0
    assert not any(d.explore for d in decisions[:3])
    never = controller(COMPUTE_BOUND, alpha_prior=0.9, explore_every=0)
    assert all(never.choose_k(16, 512) == 0 for _ in range(200))


def test_exploration_lets_estimates_recover() -> None:
    # The first draft looked useless (α_1 = 0), so speculation is off; in fact it is accepted.
    prior = (0.0, 0.9, 0.9, 0.9)
    ctrl = controller(MODERATE, alpha_prior=prior, ewma_weight=0.1, explore_every=5)
    chosen = []
    for _ in range(200):
        decision = ctrl.decide(16, 512)
        chosen.append(decision.k)
        if decision.k:
            ctrl.observe(decision.k, [decision.k] * 4)  # drafts are in fact always accepted
    assert chosen[0] == 0
    assert all(k == 4 for k in chosen[-20:])


def test_controller_refuses_k_max_beyond_the_table() -> None:
    short = table_of(lambda b, c, g: 1.0, gammas=(1, 2, 4, 8, 16))
    with pytest.raises(ValueError, match="k_max=4 needs .* γ=25"):
        controller(short, k_max=4)
    assert controller(short, k_max=3).choose_k(1, 128) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k_max": 0}, "k_max"),
        ({"alpha_prior": 1.5}, "alpha_prior"),
        ({"alpha_prior": (0.5, 0.5)}, "alpha_prior has 2 values"),
        ({"ewma_weight": 0.0}, "ewma_weight"),
        ({"margin": -0.1}, "margin"),
        ({"explore_every": -1}, "explore_every"),
        ({"probe_steps": 0}, "probe_steps"),
        ({"calibrate_steps": -1}, "calibrate_steps"),
        ({"time_window": 2, "calibrate_steps": 3}, "time_window"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ControllerConfig(**kwargs)


# --- online calibration from served step times ----------------------------------------------


def step_seconds(k: int, bs: int) -> float:
    """A compute-bound host: a step costs in proportion to its (k+1)² tokens per request."""
    return 0.001 * bs * (k + 1) ** 2


def run(ctrl: SpeculationController, bs: int, steps: int, seconds=step_seconds) -> list:
    decisions = []
    for _ in range(steps):
        decision = ctrl.decide(bs, 256)
        decisions.append(decision)
        ctrl.observe_step(decision.k, bs, seconds(decision.k, bs))
    return decisions


def test_step_times_lower_quartile_of_a_window_per_bucket() -> None:
    times = StepTimes(window=3, min_samples=2)
    times.update(16, 2, 9.0)  # a first step after start-up: lazy initialisation
    assert times.get(16, 2) is None  # one sample is not a measurement
    times.update(16, 2, 1.0)
    assert times.get(16, 2) == pytest.approx(1.0)  # the outlier does not decide
    times.update(16, 2, 1.2)
    times.update(16, 2, 1.4)
    times.update(16, 2, 1.6)
    assert times.get(16, 2) == pytest.approx(1.2)  # only the last 3 count
    assert times.get(14, 2) == pytest.approx(1.2)  # 14 and 16 share the bucket log2 ~ 4
    assert times.get(8, 2) is None and times.get(16, 1) is None
    times.update(16, 2, float("nan"))
    times.update(16, 2, 0.0)
    assert times.count(16, 2) == 5
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 6, 32)] == [0, 1, 2, 2, 3, 5]
    with pytest.raises(ValueError, match="min_samples"):
        StepTimes(window=2, min_samples=3)


def test_step_times_in_chunks_average_before_the_quartile() -> None:
    """``chunk`` steps make one sample: a slow mode that every few steps has is kept in the
    price (a lower quartile of single steps would keep only the fast mode)."""
    times = StepTimes(window=9, min_samples=2, chunk=4)
    assert times.steps_to_measure(32, 3) == 8
    for seconds in [0.1, 0.25, 0.1]:
        times.update(32, 3, seconds)
    assert times.get(32, 3) is None and times.count(32, 3) == 0
    assert times.steps_to_measure(32, 3) == 5
    for seconds in [0.25] + [0.1, 0.25] * 2:
        times.update(32, 3, seconds)
    assert times.count(32, 3) == 2 and times.steps_to_measure(32, 3) == 0
    assert times.get(32, 3) == pytest.approx(0.175)
    with pytest.raises(ValueError, match="chunk"):
        StepTimes(chunk=0)


def test_calibration_measures_k0_first_and_corrects_an_optimistic_table() -> None:
    # The table says speculation is free (τ = 1); the served steps say it is compute-bound.
    ctrl = controller(MEMORY_BOUND, alpha_prior=0.7, calibrate_steps=3, explore_every=0)
    decisions = run(ctrl, 16, 60)
    assert [d.source for d in decisions[:3]] == ["calibrate"] * 3
    assert all(d.k == 0 for d in decisions[:3])
    assert decisions[3].k == 4 and decisions[3].source == "table"
    # Each k the table favours is used until measured, then dropped: S = λ(k) / (k+1)² < 1.
    tried = {d.k for d in decisions if d.k}
    assert tried == {1, 2, 3, 4}
    assert all(d.k == 0 for d in decisions[-20:])
    final = ctrl.predict(2, 16, 256)
    assert final.source == "measured"
    assert final.tau == pytest.approx(1 / 9)


def test_calibration_keeps_speculating_where_steps_are_cheap() -> None:
    # A pessimistic table (compute-bound) but measured steps cost the same for every k.
    ctrl = controller(COMPUTE_BOUND, alpha_prior=0.7, calibrate_steps=2, explore_every=0)
    run(ctrl, 16, 2, seconds=lambda k, bs: 0.01)
    assert ctrl.choose_k(16, 256) == 0  # only T(0) measured: the table still rules k > 0
    no_table = controller(MEMORY_BOUND, alpha_prior=0.7, calibrate_steps=2, explore_every=0)
    no_table.table = None
    decisions = run(no_table, 16, 30, seconds=lambda k, bs: 0.01)
    # Without a table every k is measured (probes of calibrate_steps steps), then k_max wins.
    assert [d.k for d in decisions[:10]] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert all(d.k == 4 and d.source == "measured" for d in decisions[10:])


def test_controller_without_table_needs_calibration() -> None:
    with pytest.raises(ValueError, match="calibrate_steps"):
        SpeculationController(None, MTPGatedLoRACost(), ControllerConfig())
    ctrl = SpeculationController(None, MTPGatedLoRACost(), ControllerConfig(calibrate_steps=1))
    assert ctrl.decide(4, 128).source == "calibrate"


def test_calibration_is_per_batch_size_bucket() -> None:
    ctrl = controller(MEMORY_BOUND, alpha_prior=0.7, calibrate_steps=2, explore_every=0)
    run(ctrl, 1, 20, seconds=lambda k, bs: 0.01)  # bs 1: every k costs the same
    assert ctrl.choose_k(1, 256) == 4
    first_at_32 = run(ctrl, 32, 2)
    assert [d.source for d in first_at_32] == ["calibrate", "calibrate"]
    run(ctrl, 32, 40)
    assert ctrl.choose_k(32, 256) == 0  # compute-bound at bs 32
    assert ctrl.predict(4, 1, 256).tau == pytest.approx(1.0)  # bs 1 keeps its own times


def test_speculating_controller_refreshes_t0_and_probes_from_k0() -> None:
    ctrl = controller(MEMORY_BOUND, alpha_prior=0.7, calibrate_steps=1, explore_every=4)
    decisions = run(ctrl, 8, 12, seconds=lambda k, bs: 0.01)
    ks = [d.k for d in decisions]
    assert ks[0] == 0  # calibration
    refresh = [i for i, d in enumerate(decisions) if d.explore and d.k == 0]
    assert refresh == [5, 10]  # one plain step after every 4 speculative steps
    off = controller(COMPUTE_BOUND, alpha_prior=0.9, explore_every=3, probe_steps=2)
    probes = [d.k > 0 for d in (off.decide(16, 512) for _ in range(13))]
    assert probes == [False] * 3 + [True, True] + [False] * 6 + [True, True]


def test_without_table_one_expensive_draft_rules_out_the_rest() -> None:
    # One draft already costs 3 plain steps: with α ≈ 0.7 no k can pay, since T(k) >= T(1).
    ctrl = controller(MEMORY_BOUND, alpha_prior=0.7, calibrate_steps=2, explore_every=0)
    ctrl.table = None
    decisions = run(ctrl, 4, 30, seconds=lambda k, bs: 0.01 * (1 + 2 * min(k, 1)))
    assert [d.k for d in decisions[:4]] == [0, 0, 1, 1]  # k = 2..4 are never measured
    assert all(d.k == 0 for d in decisions[4:])
    bound = ctrl.predict(3, 4, 256)
    assert bound.source == "bound" and bound.tau == pytest.approx(1 / 3)
    assert ctrl.predict(1, 4, 256).source == "measured"


def test_bound_keeps_probing_where_the_next_k_might_pay() -> None:
    # T(1) = 1.2 T(0): k = 2 is bounded by τ <= 1/1.2 and λ(2) = 2.71 > 1.2, so it is measured.
    ctrl = controller(MEMORY_BOUND, alpha_prior=0.9, calibrate_steps=1, explore_every=0)
    ctrl.table = None
    decisions = run(ctrl, 4, 6, seconds=lambda k, bs: 0.01 * (1 + 0.2 * k))
    assert [d.k for d in decisions[:5]] == [0, 1, 2, 3, 4]
    assert decisions[5].source == "measured"


def test_switch_on_margin_is_hysteresis() -> None:
    # MODERATE, k=1: S = (1 + α)/sqrt(2): α = 0.6 -> 1.131, α = 0.43 -> 1.011.
    config = {"k_max": 1, "margin": 0.0, "switch_on_margin": 0.05, "explore_every": 0}
    on = controller(MODERATE, alpha_prior=0.6, **config)
    assert on.choose_k(1, 128) == 1
    on.acceptance.alphas = [0.43]
    assert on.choose_k(1, 128) == 1  # already speculating: a marginal gain keeps it on
    off = controller(MODERATE, alpha_prior=0.43, **config)
    assert all(off.choose_k(1, 128) == 0 for _ in range(5))  # not worth switching on
    with pytest.raises(ValueError, match="switch_on_margin"):
        ControllerConfig(switch_on_margin=-1.0)


def test_new_batch_bucket_is_bounded_by_a_smaller_measured_batch() -> None:
    # bs 1 measures that one draft costs 3 plain steps; bs 8 then only calibrates k = 0.
    ctrl = controller(MEMORY_BOUND, alpha_prior=0.7, calibrate_steps=2, explore_every=0)
    ctrl.table = None
    slow_draft = lambda k, bs: 0.01 * (1 + 2 * min(k, 1))  # noqa: E731
    run(ctrl, 1, 10, seconds=slow_draft)
    at_8 = run(ctrl, 8, 10, seconds=slow_draft)
    assert [d.k for d in at_8] == [0] * 10  # no probe of k = 1 at bs 8
    bound = ctrl.predict(1, 8, 256)
    assert bound.source == "bound" and bound.tau == pytest.approx(1 / 3)
    # Where the smaller batch found drafts cheap, the new bucket still measures them itself.
    cheap = controller(MEMORY_BOUND, alpha_prior=0.7, calibrate_steps=2, explore_every=0)
    cheap.table = None
    run(cheap, 1, 12, seconds=lambda k, bs: 0.01)
    at_8 = run(cheap, 8, 6, seconds=step_seconds)
    assert [d.k for d in at_8] == [0, 0, 1, 1, 0, 0]  # k = 1 measured at bs 8: too dear
    assert cheap.predict(1, 8, 256).source == "measured"


def test_a_larger_batch_does_not_bound_a_smaller_one() -> None:
    ctrl = controller(MEMORY_BOUND, alpha_prior=0.7, calibrate_steps=2, explore_every=0)
    ctrl.table = None
    run(ctrl, 32, 10, seconds=lambda k, bs: 0.01 * (1 + 2 * min(k, 1)))
    at_1 = run(ctrl, 1, 4, seconds=lambda k, bs: 0.01)
    assert [d.k for d in at_1] == [0, 0, 1, 1]  # bs 1 probes k = 1 on its own
    assert ctrl.times.tau_from_smaller_batch(1, 1) is None


def test_warmup_steps_are_plain_and_unrecorded_then_t0_needs_a_full_window() -> None:
    # A fresh server: the first 4 steps cost 10x. Recorded, they would make T(0) look so dear
    # that k = 1 (2x a steady plain step) seemed to pay; warm-up keeps them out.
    def fresh(k: int, bs: int, seen=[0]) -> float:  # noqa: B006
        seen[0] += 1
        base = 0.01 * (1 + min(k, 1))
        return base * 10 if seen[0] <= 4 else base

    ctrl = controller(
        MEMORY_BOUND, alpha_prior=0.5, calibrate_steps=3, explore_every=0, warmup_steps=4
    )
    ctrl.table = None
    decisions = run(ctrl, 1, 40, seconds=fresh)
    assert [d.k for d in decisions[:13]] == [0] * 13  # 4 warm-up + a window of 9 plain steps
    assert ctrl.times.count(1, 0) == 40 - 4 - 3  # warm-up steps are not recorded
    assert [d.k for d in decisions[13:16]] == [1, 1, 1]  # then k = 1 is measured once
    assert all(d.k == 0 for d in decisions[16:])  # λ(1) = 1.5 < T(1)/T(0) = 2
    assert ctrl.predict(1, 1, 256).tau == pytest.approx(0.5)
    with pytest.raises(ValueError, match="warmup_steps"):
        ControllerConfig(warmup_steps=-1)
