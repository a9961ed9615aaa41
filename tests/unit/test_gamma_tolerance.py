"""benchmarks/gamma_tolerance.py: the pure helpers, then one end-to-end run inside SGLang on a
tiny random Llama (schema and files only: timings on a CI host are not asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

import gamma_tolerance as bench  # noqa: E402

from sgl_spec.control.controller import ControllerConfig, SpeculationController  # noqa: E402
from sgl_spec.control.cost_model import GammaTable, MTPGatedLoRACost  # noqa: E402

POINT_KEYS = {
    "batch_size", "ctx_len", "gamma", "mean_ms", "median_ms", "p10_ms", "p90_ms", "num_iters",
    "tau",
}  # fmt: skip
TOP_KEYS = {
    "schema_version", "command", "host", "model", "dtype", "device", "attention_backend",
    "logits", "warmup", "iters", "batch_sizes", "ctx_lens", "gammas", "points",
    "predicted_speedup",
}  # fmt: skip


def test_summarize_and_tau() -> None:
    stats = bench.summarize([0.001 * t for t in range(1, 12)])  # 1..11 ms
    assert stats["median_ms"] == pytest.approx(6.0)
    assert stats["mean_ms"] == pytest.approx(6.0)
    assert (stats["p10_ms"], stats["p90_ms"]) == (pytest.approx(2.0), pytest.approx(10.0))
    assert stats["num_iters"] == 11
    points = [
        {"batch_size": b, "ctx_len": 16, "gamma": g, "median_ms": ms}
        for b, g, ms in [(1, 1, 2.0), (1, 4, 2.5), (8, 1, 4.0), (8, 4, 10.0)]
    ]
    bench.add_tau(points)
    assert [p["tau"] for p in points] == pytest.approx([1.0, 0.8, 1.0, 0.4])
    rows = bench.speedup_rows(points, [2.0, 3.0], 0.1)
    assert [(r["batch_size"], r["num_drafts"]) for r in rows] == [(1, 3), (8, 3)]
    assert rows[0]["speedup"]["2.0"] == pytest.approx(2 * 0.8 / (1 + 3 * 0.1 * 0.8))
    assert rows[1]["speedup"]["3.0"] == pytest.approx(3 * 0.4 / (1 + 3 * 0.1 * 0.4))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gammas", "2,4"], "must include 1"),
        (["--iters", "0"], "--iters"),
        (["--model-path", "sgl-spec/nope"], "--model-path"),
        (["--batch-sizes", "0,2"], "integers >= 1"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_end_to_end_on_a_tiny_llama(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import build_llama

    model = build_llama(tmp_path / "model", seed=0)
    out = tmp_path / "out" / "tau.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "gamma_tolerance.py"),
        "--model-path", str(model), "--batch-sizes", "1,2", "--ctx-lens", "16",
        "--gammas", "1,2,4", "--warmup", "1", "--iters", "2", "--threads", "1",
        "--json", str(out), "--lam", "2,3",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "predicted speedup, equation 1" in proc.stdout

    result = json.loads(out.read_text())
    assert TOP_KEYS <= set(result)
    assert result["model"] == str(model.resolve())
    assert (result["dtype"], result["logits"]) == ("float32", "all")
    assert {"cpu_count", "torch_version", "sglang_version", "device"} <= set(result["host"])
    points = result["points"]
    assert {(p["batch_size"], p["ctx_len"], p["gamma"]) for p in points} == {
        (b, 16, g) for b in (1, 2) for g in (1, 2, 4)
    }
    for p in points:
        assert set(p) == POINT_KEYS
        for key in ("mean_ms", "median_ms", "p10_ms", "p90_ms", "tau"):
            assert math.isfinite(p[key]) and p[key] > 0, p
        assert p["p10_ms"] <= p["median_ms"] <= p["p90_ms"]
        assert p["num_iters"] == 2
        if p["gamma"] == 1:
            assert p["tau"] == 1.0
    speedup = result["predicted_speedup"]
    assert (speedup["delta"], speedup["lams"]) == (0.0, [2.0, 3.0])
    assert len(speedup["rows"]) == 4  # 2 batch sizes x drafts {1, 3}
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = GammaTable.load(out)
    assert table.gammas == (1, 2, 4)
    decision = SpeculationController(table, MTPGatedLoRACost(), ControllerConfig(k_max=1)).decide(
        2, 16
    )
    assert decision.k in (0, 1)
