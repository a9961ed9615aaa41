"""sgl_spec.controller: equation 1, the τ table, and the k chosen from τ and acceptance."""

from __future__ import annotations

import json
import math

import pytest

from sgl_spec.controller import (
    ControllerConfig,
    DrafterCost,
    GammaTable,
    MTPGatedLoRACost,
    SpeculationController,
    predicted_speedup,
)

BATCH_SIZES = (1, 16, 128)
CTX_LENS = (128, 1024)
GAMMAS = (1, 2, 4, 8, 16, 25)


def table_of(tau_fn, gammas=GAMMAS) -> GammaTable:  # noqa: ANN001
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


def controller(table: GammaTable, cost=None, **config) -> SpeculationController:  # noqa: ANN001
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
def test_equation_1_matches_hand_computed(lam, tau, gamma, delta, expected) -> None:  # noqa: ANN001
    assert predicted_speedup(lam, tau, gamma, delta) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "args", [(0.9, 1.0, 1, 0.0), (2.0, 0.0, 1, 0.0), (2.0, 1.0, -1, 0.0), (2.0, 1.0, 1, -0.1)]
)
def test_equation_1_rejects_out_of_domain(args) -> None:  # noqa: ANN001
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


def test_table_loads_the_benchmark_json(tmp_path) -> None:  # noqa: ANN001
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
def test_compute_bound_turns_speculation_off(cost, bs: int) -> None:  # noqa: ANN001
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
    decisions = [ctrl.decide(16, 512) for _ in range(8)]
    assert [d.k > 0 for d in decisions] == [False, False, False, True] + [False] * 3 + [True]
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
    ],
)
def test_config_validation_names_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ControllerConfig(**kwargs)
