"""The load-step benchmark's pure parts (``benchmarks/load_step.py``): phases, the Prometheus
text it reads, the k windows, steady levels and the follow time. No server."""

from __future__ import annotations

import load_step
import pytest
from load_step import Phase

EXPOSITION = """\
# HELP sglang:spec_chosen_k Drafts per request chosen for a step.
# TYPE sglang:spec_chosen_k histogram
sglang:spec_chosen_k_bucket{le="0.0",model_name="m"} 3.0
sglang:spec_chosen_k_sum{model_name="m"} 21.0
sglang:spec_chosen_k_count{model_name="m"} 6.0
sglang:spec_chosen_k_sum{model_name="other"} 1.0
sglang:spec_chosen_k_count_extra{model_name="m"} 99.0
sglang:spec_plain_steps_total 3.0
"""


def test_phases_parse_and_refuse() -> None:
    assert load_step.parse_phases("1:60,32:30.5") == [Phase(1, 60.0), Phase(32, 30.5)]
    for bad in ("1:60", "1-60,2:3", "0:10,1:10", "1:0,2:5", "a:1,b:2"):
        with pytest.raises(ValueError, match="--phases"):
            load_step.parse_phases(bad)
    phases = [Phase(1, 10), Phase(32, 5)]
    at = [load_step.concurrency_at(phases, t) for t in (0, 9.9, 10, 14.9, 15)]
    assert at == [1, 1, 32, 32, 0]


def test_metric_totals_sum_label_sets_of_that_series_only() -> None:
    assert load_step.sample(EXPOSITION) == {"k_sum": 22.0, "k_count": 6.0, "plain": 3.0}
    assert load_step.metric_total("", load_step.K_METRIC + "_sum") == 0.0


def _trace(levels: list[tuple[float, float]], steps_per_s: float = 10.0) -> list[dict]:
    """Scrapes every 0.5 s; ``levels``: (until_s, k chosen on every step until then)."""
    samples, k_sum, count, t = [], 0.0, 0.0, 0.0
    for until, k in levels:
        while t < until:
            samples.append({"t": t, "k_sum": k_sum, "k_count": count, "inflight": int(k) + 1})
            k_sum += k * steps_per_s * 0.5
            count += steps_per_s * 0.5
            t += 0.5
    return samples


def test_windows_steady_levels_and_follow_time() -> None:
    # k 7 until 20 s, 0 from 20 s (the load reached at 20 s), followed after a 3 s lag
    samples = _trace([(23.0, 7.0), (60.0, 0.0)])
    for s in samples:
        s["inflight"] = 1 if s["t"] < 20 else 32
    wins = load_step.windows(samples, 2.0)
    assert all(w["steps_per_s"] == pytest.approx(10.0) for w in wins)
    assert load_step.steady_k(wins, 0, 20) == pytest.approx(7.0)
    assert load_step.steady_k(wins, 20, 60) == pytest.approx(0.0)
    phases = [Phase(1, 20), Phase(32, 40)]
    (row,) = load_step.transitions(phases, samples, wins)
    assert row["load_reached_s"] == 20.0
    assert 2.0 <= row["follow_s"] <= 4.0  # the window straddling 23 s is the first past 3.5
    assert row["steady_k_before"] == pytest.approx(7.0) and row["steady_k_after"] == 0.0


def test_no_change_and_never_followed_are_reported() -> None:
    samples = _trace([(40.0, 2.0)])
    wins = load_step.windows(samples, 2.0)
    (row,) = load_step.transitions([Phase(3, 20), Phase(3, 20)], samples, wins)
    assert row["follow_s"] is None and "nothing to follow" in row["note"]
    # the level changes only in the second half of the new phase: half-way crossed late
    assert load_step.follow_time(wins, 20.0, 40.0, 2.0, 0.0) is None
    samples = _trace([(35.0, 2.0), (40.0, 0.0)])
    wins = load_step.windows(samples, 2.0)
    assert load_step.follow_time(wins, 20.0, 40.0, 2.0, 0.0) == pytest.approx(15.0, abs=1.0)


def test_windows_without_steps_have_no_mean() -> None:
    samples = [{"t": t / 2, "k_sum": 0.0, "k_count": 0.0, "inflight": 0} for t in range(10)]
    wins = load_step.windows(samples, 2.0)
    assert wins and all(w["mean_k"] is None and w["steps"] == 0 for w in wins)
