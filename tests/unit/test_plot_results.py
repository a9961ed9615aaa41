"""benchmarks/plot_results.py: the headline figures and ratio table from a constructed sweep
JSON (no servers)."""

from __future__ import annotations

import json

import plot_results as plot
import pytest

HOST = {"cpu_count": 2, "cpu_model": "Test EPYC", "device": "cpu"}
COMMAND = (
    "/x/.venv/bin/python benchmarks/bench_speculative.py --algorithms none,standalone,"
    "mtp_lora_auto,specblock --concurrency 1,4,16 --interleave --rounds 2"
)
TOK_S = {  # per concurrency: (round 1, round 2)
    "none": {1: (20.0, 22.0), 4: (40.0, 44.0), 16: (80.0, 88.0)},
    "standalone": {1: (25.0, 22.0), 4: (30.0, 33.0), 16: (40.0, 44.0)},
    "mtp_lora_auto": {1: (20.0, 20.0), 4: (40.0, 40.0), 16: (90.0, 99.0)},
}
TRACE = [  # k over time: plain steps, a one-step probe, plain again, then at c = 4
    {"t_start_s": 1.0, "t_end_s": 3.0, "k": 0, "batch_size": 1, "num_steps": 40},
    {"t_start_s": 3.0, "t_end_s": 3.1, "k": 2, "batch_size": 1, "num_steps": 1},
    {"t_start_s": 3.1, "t_end_s": 5.0, "k": 0, "batch_size": 1, "num_steps": 39},
    {"t_start_s": 20.0, "t_end_s": 25.0, "k": 1, "batch_size": 4, "num_steps": 20},
]
SPANS = {1: [(1.0, 5.0), (6.0, 6.5)], 4: [(20.0, 25.0), (26.0, 26.5)], 16: [(40.0, 41.0)] * 2}


def row(name: str, c: int) -> dict:
    rounds = [
        {
            "output_throughput": tok_s,
            "mean_tpot_ms": 1000.0 / tok_s,
            "median_tpot_ms": 900.0 / tok_s,
            "t_start_s": SPANS[c][r][0],
            "t_end_s": SPANS[c][r][1],
        }
        for r, tok_s in enumerate(TOK_S[name][c])
    ]
    medians = {m: sum(r[m] for r in rounds) / 2 for m in ("output_throughput", "median_tpot_ms")}
    return {
        "algorithm": name,
        "max_concurrency": c,
        **medians,
        "mean_tpot_ms": 1000.0 / medians["output_throughput"],
        "mean_accept_length": None if name == "none" else 2.0,
        "greedy_equal_baseline": None if name == "none" else True,
        "rounds": rounds,
    }


def sweep_result() -> dict:
    runs = [row(name, c) for c in (1, 4, 16) for name in TOK_S]
    runs += [{"algorithm": "specblock", "max_concurrency": c, "error": "server start: x"} for c in (1, 4, 16)]  # fmt: skip
    c4_auto = [(r["algorithm"], r["max_concurrency"]) for r in runs].index(("mtp_lora_auto", 4))
    runs[c4_auto] = {"algorithm": "mtp_lora_auto", "max_concurrency": 4, "error": "bench | x"}
    return {
        "command": COMMAND,
        "host": HOST,
        "date": "2026-11-26T10:00:00+00:00",
        "concurrencies": [1, 4, 16],
        "runs": runs,
        "mtp_k_trace": {"mtp_lora_auto": TRACE},
    }


def lines_by_label(ax) -> dict[str, tuple[list, list]]:
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


def test_every_algorithm_but_the_reference_gets_a_png(tmp_path, capsys) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep_result()))
    assert plot.main([str(path), "--out-dir", str(tmp_path / "img"), "--table"]) == 0
    written = sorted(p.name for p in (tmp_path / "img").iterdir())
    assert written == ["mtp_lora_auto.png", "standalone.png"]  # specblock failed everywhere
    for name in written:
        data = (tmp_path / "img" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 150_000
    table = capsys.readouterr().out
    assert "| 1 | standalone | 23.50 | 1.125 |" in table  # paired: median(25/20, 22/22)
    assert "| 4 | mtp_lora_auto | failed: bench / x |" in table


def test_throughput_and_tpot_panels_show_algorithm_against_none() -> None:
    fig = plot.figure(sweep_result(), "standalone")
    throughput, tpot = fig.axes
    lines = lines_by_label(throughput)
    assert lines == {"none": ([1, 4, 16], [21.0, 42.0, 84.0]), "standalone": ([1, 4, 16], [23.5, 31.5, 42.0])}  # fmt: skip
    ratios = [t.get_text() for t in throughput.texts]
    assert ratios == ["1.12x", "0.75x", "0.50x"]  # paired over rounds
    none_tpot = lines_by_label(tpot)["none"]
    assert none_tpot[0] == [1, 4, 16]
    expected = [(900 / a + 900 / b) / 2 for a, b in TOK_S["none"].values()]
    assert none_tpot[1] == pytest.approx(expected)  # median TPOT, not the mean
    assert "median TPOT" in tpot.get_ylabel()
    title = fig.get_suptitle()
    assert "Test EPYC" in title and "2026-11-26" in title
    assert "python benchmarks/bench_speculative.py --algorithms" in title and "/x/" not in title


def test_mtp_lora_gets_the_k_trace_panel_and_skips_its_failed_point() -> None:
    fig = plot.figure(sweep_result(), "mtp_lora_auto")
    assert len(fig.axes) == 3
    assert lines_by_label(fig.axes[0])["mtp_lora_auto"][0] == [1, 16]  # c = 4 failed
    k_panel = fig.axes[2]
    (segments,) = k_panel.collections
    starts = [seg[0].tolist() for seg in segments.get_segments()]
    assert starts == [[1.0, 0.0], [3.0, 2.0], [3.1, 0.0], [20.0, 1.0]]
    legend = [t.get_text() for t in k_panel.get_legend().get_texts()]
    assert legend == ["c=1: mean k 0.03 over 80 steps", "c=16: no decode steps"]
    assert [p.get_x() for p in k_panel.patches] == [1.0, 6.0, 40.0, 40.0]  # c = 4 failed


def test_a_single_concurrency_json_without_date_still_plots(tmp_path) -> None:
    result = sweep_result()
    result.pop("date"), result.pop("mtp_k_trace")
    result["command"] = "python bench_speculative.py --max-concurrency 8"
    result["runs"] = [
        {k: v for k, v in row(n, 1).items() if k not in ("max_concurrency", "median_tpot_ms")}
        for n in ("none", "standalone")
    ]
    fig = plot.figure(result, "standalone")
    assert len(fig.axes) == 2
    assert lines_by_label(fig.axes[0])["standalone"][0] == [8]
    assert "mean TPOT" in fig.axes[1].get_ylabel()
    assert "date not recorded" in fig.get_suptitle()
