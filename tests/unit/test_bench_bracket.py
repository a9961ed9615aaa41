"""benchmarks/_bracket.py and ``bench_speculative.py --bracket``: each run divided by the
reference runs just before and after it (no servers)."""

from __future__ import annotations

import json

import _bench_lib as lib
import _bracket
import bench_speculative as bench
import pytest

from tests.unit.test_bench_speculative import HOST_KEYS, FakeServer, fake_run


def test_the_reference_runs_first_last_and_between_every_two_others() -> None:
    assert _bracket.bracketed_order(["none", "b", "c"], "none") == [
        "none", "b", "none", "c", "none",
    ]  # fmt: skip
    assert _bracket.bracketed_order(["c", "b", "none"], "none") == [
        "none", "c", "none", "b", "none",
    ]  # fmt: skip


def test_each_run_gets_the_reference_around_it() -> None:
    brackets = _bracket.Brackets("none")
    runs = [fake_run(name, v, [[1]]) for name, v in [("none", 10), ("b", 12), ("none", 8)]]
    failed = {"algorithm": "c", "error": "boom"}
    for run in runs:
        brackets.ran(run["algorithm"], run)
    brackets.ran("c", failed)
    brackets.ran("none", fake_run("none", 6, [[1]]))
    assert runs[1][_bracket.BRACKET_KEY] == [10, 8]
    assert _bracket.BRACKET_KEY not in failed and _bracket.BRACKET_KEY not in runs[0]
    assert brackets.count == 3
    assert _bracket.bracketed_ratios(runs[1], "output_throughput") == [pytest.approx(12 / 9)]
    assert _bracket.bracketed_ratios(runs[0], "output_throughput") is None  # the reference


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--algorithms", "none,standalone", "--bracket"], "add --interleave"),
        (
            ["--algorithms", "none", "--bracket", "--interleave", "--max-total-tokens", "4096"],
            "needs a second algorithm",
        ),
    ],
)
def test_bracket_needs_interleave_and_two_algorithms(argv: list[str], message: str) -> None:
    with pytest.raises(lib.BenchError, match=message):
        lib.parse_args(argv)


def test_bracket_cancels_drift_within_a_round(monkeypatch, tmp_path) -> None:
    """The host slows by 10% a run; b serves 1.2x and c 0.9x `none` at any speed. Paired with
    the round's first `none` run they read 1.08 and 0.63; bracketed, 1.2 and 0.9."""
    log: list = []
    true_speed = {"none": 10.0, "b": 12.0, "c": 9.0}
    slot = [0]

    def fake_start(name: str, port: int, args, extra, work) -> FakeServer:
        return FakeServer(name, log)

    def fake_measure(server: FakeServer, name: str, args, extra, work) -> dict:
        host = 1.0 - 0.1 * (slot[0] % 5)  # each round starts on a fresh host: 1.0 .. 0.6
        slot[0] += 1
        log.append(("measure", name, work.name))
        return fake_run(name, true_speed[name] * host, [[1]])

    monkeypatch.setattr(bench, "start_server", fake_start)
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "host_info", lambda: dict.fromkeys(HOST_KEYS, "h"))
    out = tmp_path / "out.json"
    argv = ["--algorithms", "none,b,c", "--rounds", "2", "--interleave", "--bracket",
            "--max-total-tokens", "4096", "--json", str(out), "--log-dir", str(tmp_path)]  # fmt: skip
    monkeypatch.setitem(lib.ALGORITHMS, "b", lib.ALGORITHMS["standalone"])
    monkeypatch.setitem(lib.ALGORITHMS, "c", lib.ALGORITHMS["specblock"])
    assert bench.main(argv) == 0
    measured = [entry[1:] for entry in log if entry[0] == "measure"]
    assert measured == [
        ("none", "round0"), ("b", "round0"), ("none", "round0-1"), ("c", "round0"),
        ("none", "round0-2"),
        ("none", "round1"), ("c", "round1"), ("none", "round1-1"), ("b", "round1"),
        ("none", "round1-2"),
    ]  # fmt: skip
    none, b, c = json.loads(out.read_text())["runs"]
    assert len(none["rounds"]) == 2  # one reference run per round counts as its own
    assert b["ratios"]["output_throughput_bracketed"] == pytest.approx(1.2)
    assert c["ratios"]["output_throughput_bracketed"] == pytest.approx(0.9)
    assert b["ratios"]["output_throughput_bracketed_range"] == pytest.approx([1.2, 1.2])
    assert b["ratios"]["output_throughput_paired"] == pytest.approx((1.08 + 0.84) / 2)
    assert "output_throughput_bracketed" not in none["ratios"]
    table = lib.format_table(json.loads(out.read_text())["runs"])
    header, _, row_b, _ = table.splitlines()
    assert header.split()[-4:] == ["x", "bracketed", "bracketed", "min-max"]
    assert row_b.split()[-2:] == ["1.200", "1.20-1.20"]
