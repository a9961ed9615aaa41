"""The forward-cost pooling and the step cost model, on constructed measurements."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

import cost_model  # noqa: E402
import forward_cost  # noqa: E402


def _forward_cost() -> dict:
    rows = []
    for model, per_token in (("T", 1.0), ("D", 0.25)):
        for n, ms in ((1, 10.0), (4, 13.0), (16, 25.0)):
            rows.append({"model": model, "batch_size": 1, "num_tokens": n,
                         "served_ms": ms * per_token, "bare_ms": ms})  # fmt: skip
    rows.append({"model": "T", "batch_size": 8, "num_tokens": 1, "served_ms": 99.0})
    return {"target": "T", "draft": "D", "rows": rows}


def test_interpolate_between_and_past_measured_points() -> None:
    points = {1: 10.0, 4: 13.0, 16: 25.0}
    assert cost_model.interpolate(points, 4) == 13.0
    assert cost_model.interpolate(points, 2) == pytest.approx(11.0)
    assert cost_model.interpolate(points, 9) == pytest.approx(18.0)
    assert cost_model.interpolate(points, 20) == pytest.approx(29.0)


def test_step_costs_and_predicted_speedup() -> None:
    bench = {"runs": [
        {"algorithm": "none", "mean_accept_length": None, "ratios": {}},
        {"algorithm": "standalone-fixed", "mean_accept_length": 3.0,
         "ratios": {"output_throughput": 1.1, "output_throughput_paired": 1.05}},
        {"algorithm": "mtp_lora", "mean_accept_length": 2.0, "ratios": {"output_throughput": 0.9}},
        {"algorithm": "specblock-fixed", "mean_accept_length": 3.5, "draft_share_pct": 50.0,
         "ratios": {"output_throughput": 0.8}},
        {"algorithm": "hf", "mean_accept_length": None, "ratios": {"output_throughput": 0.7}},
    ]}  # fmt: skip
    args = cost_model.parse_args(["--forward-cost", "x", "--bench", "y"])
    rows = {r["algorithm"]: r for r in cost_model.model_rows(_forward_cost(), bench, args)}
    # standalone, 3 steps: target 4 tokens (13) + 2 draft decodes (2.5 each) + draft 5 tokens
    standalone = 13.0 + 2 * 2.5 + 0.25 * 14.0
    assert rows["standalone-fixed"]["step_in_decodes"] == pytest.approx(standalone / 10.0)
    assert rows["standalone-fixed"]["predicted_speedup"] == pytest.approx(3.0 * 10.0 / standalone)
    assert rows["standalone-fixed"]["measured_speedup"] == 1.05  # the paired ratio when present
    assert rows["standalone-fixed"]["measured_step_in_decodes"] == pytest.approx(3.0 / 1.05)
    assert rows["standalone-fixed"]["accept_needed"] == pytest.approx(1.3 * standalone / 10.0)
    assert rows["mtp_lora"]["predicted_speedup"] == pytest.approx(2.0 * 10.0 / 18.0)  # 9 tokens
    assert rows["specblock-fixed"]["step_in_decodes"] == pytest.approx(2 * 17.0 / 10.0)  # 8 nodes
    assert "predicted_speedup" not in rows["hf"]
    assert "none" not in rows


def test_forward_cost_pools_rounds_by_median_and_summarises() -> None:
    def run(model: str, served: float) -> dict:
        return {"model": model, "points": [
            {"batch_size": 1, "num_tokens": 1, "bare_ms": 10.0, "served_ms": served},
            {"batch_size": 1, "num_tokens": 4, "bare_ms": 12.0, "served_ms": 2 * served},
        ]}  # fmt: skip

    rows = forward_cost.pool_runs([run("T", 10.0), run("T", 14.0), run("T", 12.0),
                                   run("D", 2.0), run("D", 3.0)])  # fmt: skip
    by_key = {(r["model"], r["num_tokens"]): r for r in rows}
    assert by_key[("T", 1)]["served_ms"] == 12.0
    assert by_key[("T", 1)]["served_over_bare"] == pytest.approx(1.2)
    assert by_key[("D", 4)]["served_ms"] == 5.0
    summary = forward_cost.summary(rows, "T", "D")
    assert summary["served_tau"]["T bs=1 T(4)/T(1)"] == pytest.approx(2.0)
    assert summary["draft_over_target"]["bs=1 n=1"] == pytest.approx(2.5 / 12.0)


def test_mtp_step_priced_by_its_gated_forward_where_timed() -> None:
    fc = _forward_cost()
    fc["rows"] += [
        {"model": "T+mtp", "batch_size": 1, "num_tokens": 9, "shape": "mtp_lora", "mtp_k": 2,
         "served_ms": 24.0, "bare_ms": None},
        {"model": "T+mtp", "batch_size": 1, "num_tokens": 9, "shape": "chain", "mtp_k": 2,
         "served_ms": 17.0, "bare_ms": None},
        {"model": "T+mtp", "batch_size": 8, "num_tokens": 9, "shape": "mtp_lora", "mtp_k": 2,
         "served_ms": 99.0, "bare_ms": None},
    ]  # fmt: skip
    bench = {"runs": [{"algorithm": "mtp_lora", "mean_accept_length": 2.0,
                       "ratios": {"output_throughput": 0.8}}]}  # fmt: skip
    args = cost_model.parse_args(["--forward-cost", "x", "--bench", "y"])
    target, draft, mtp = cost_model.served_costs(fc)
    assert mtp == {2: 24.0} and target[16] == 25.0 and 9 not in target and 9 not in draft
    (row,) = cost_model.model_rows(fc, bench, args)
    assert row["priced_as"] == "gated step"
    assert row["step_in_decodes"] == pytest.approx(2.4)  # the gated row at bs 1, not the chain
    assert row["chain_step_in_decodes"] == pytest.approx(1.8)  # interpolated 9-token chain
    assert row["measured_over_predicted"] == pytest.approx((2.0 / 0.8) / 2.4)
    args = cost_model.parse_args(["--forward-cost", "x", "--bench", "y", "--mtp-k", "3"])
    (row,) = cost_model.model_rows(fc, bench, args)  # k = 3 was not timed: the chain form
    assert row["priced_as"] == "chain verify"
    assert row["step_in_decodes"] == pytest.approx(cost_model.interpolate(target, 16) / 10.0)


def test_forward_cost_pools_mtp_rows_apart_and_without_bare() -> None:
    plain = {"model": "T", "points": [
        {"batch_size": 1, "num_tokens": 1, "bare_ms": 10.0, "served_ms": 8.0},
        {"batch_size": 1, "num_tokens": 4, "bare_ms": 12.0, "served_ms": 9.0},
    ]}  # fmt: skip

    def mtp(served: float) -> dict:
        return {"model": "T+mtp", "points": [
            {"batch_size": 1, "num_tokens": 4, "shape": "mtp_lora", "mtp_k": 1,
             "bare_ms": None, "served_ms": served},
            {"batch_size": 1, "num_tokens": 4, "shape": "chain", "mtp_k": 1,
             "bare_ms": None, "served_ms": served / 2},
        ]}  # fmt: skip

    rows = forward_cost.pool_runs([plain, mtp(20.0), mtp(30.0), mtp(22.0)])
    by_key = {(r["model"], r.get("shape")): r for r in rows if r["num_tokens"] == 4}
    assert by_key[("T+mtp", "mtp_lora")]["served_ms"] == 22.0
    assert by_key[("T+mtp", "mtp_lora")]["mtp_k"] == 1
    assert by_key[("T+mtp", "chain")]["served_ms"] == 11.0
    assert by_key[("T+mtp", "mtp_lora")]["bare_ms"] is None
    assert by_key[("T+mtp", "mtp_lora")]["served_over_bare"] is None
    assert by_key[("T", None)]["served_over_bare"] == pytest.approx(0.75)
    summary = forward_cost.summary(rows, "T", "D")  # MTP rows are not the target's T(n)
    assert summary["served_tau"] == {"T bs=1 T(4)/T(1)": pytest.approx(9.0 / 8.0)}
