"""benchmarks/bench_alternate.py: the rotating visit order, the paired ratio and its interval,
and the summary of alternating requests (no servers)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import bench_alternate as alt
import pytest


def test_every_server_goes_first_equally_often() -> None:
    names = ["none", "a", "b"]
    orders = [alt.visit_order(names, v) for v in range(6)]
    assert orders[:3] == [["none", "a", "b"], ["a", "b", "none"], ["b", "none", "a"]]
    for position in range(3):
        firsts = [order[position] for order in orders]
        assert sorted(firsts) == sorted(names * 2)


def test_paired_ratio_is_the_geometric_mean_with_an_interval_around_it() -> None:
    reference = [1.0, 2.0, 4.0, 1.5]
    times = [0.5, 1.0, 2.0, 0.75]  # every request twice as fast
    r = alt.paired_ratio(reference, times)
    assert r["ratio"] == pytest.approx(2.0) and r["ci95"] == pytest.approx([2.0, 2.0])
    times = [0.5, 1.25, 1.6, 0.75]
    noisy = alt.paired_ratio(reference, times)
    want = math.exp(sum(math.log(a / b) for a, b in zip(reference, times, strict=True)) / 4)
    assert noisy["ratio"] == pytest.approx(want)
    low, high = noisy["ci95"]
    assert low < noisy["ratio"] < high and noisy["pairs"] == 4
    with pytest.raises(ValueError):
        alt.paired_ratio([1.0], [])


def test_drive_alternates_and_summarise_pairs_the_same_prompts(monkeypatch) -> None:
    calls = []
    speed = {"http://none": 1.0, "http://fast": 0.5}

    def fake_generate(url, prompt, output_len, timeout):
        calls.append((url, tuple(prompt)))
        ids = [7] * output_len if url == "http://none" or len(calls) % 4 else [8] * output_len
        return {"seconds": speed[url], "output_ids": ids, "accept_length": 2.0}

    monkeypatch.setattr(alt, "generate", fake_generate)
    args = SimpleNamespace(rounds=2, num_prompts=3, input_len=5, output_len=4, timeout=1.0)
    servers = {
        "none": SimpleNamespace(url="http://none"),
        "fast": SimpleNamespace(url="http://fast"),
    }
    results = alt.drive(args, servers)
    assert [c[0] for c in calls[:4]] == ["http://none", "http://fast", "http://fast", "http://none"]
    assert calls[0][1] == calls[1][1] != calls[2][1]  # one prompt to both, then the next
    round_prompts = [{c[1] for c in calls[:6]}, {c[1] for c in calls[6:]}]
    assert not round_prompts[0] & round_prompts[1]  # each round draws new prompts
    rows = alt.summarise(results)
    assert rows["fast"]["ratio"] == pytest.approx(2.0)
    assert rows["fast"]["tok_per_s"] == pytest.approx(2 * rows["none"]["tok_per_s"])
    assert rows["none"]["outputs_differing"] == 0
    assert rows["fast"]["outputs_differing"] == sum(
        1 for i, c in enumerate(calls, 1) if c[0] == "http://fast" and i % 4 == 0
    )
    assert "fast" in alt.format_rows(rows)
    against_fast = alt.summarise(results, "fast")
    assert against_fast["none"]["ratio"] == pytest.approx(0.5)
    assert against_fast["fast"]["ratio"] == pytest.approx(1.0)
    assert against_fast["fast"]["outputs_differing"] == rows["fast"]["outputs_differing"]
    assert "x fast" in alt.format_rows(against_fast, "fast")


def test_it_refuses_more_than_one_request_at_a_time_and_an_unknown_reference() -> None:
    with pytest.raises(SystemExit):
        alt.main(["--algorithms", "none", "--concurrency", "4"])
    with pytest.raises(SystemExit, match="--reference"):
        alt.main(["--algorithms", "none,specblock", "--reference", "standalone"])
