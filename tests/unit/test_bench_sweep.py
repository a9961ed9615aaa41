"""bench_speculative.py --concurrency (a sweep on the same servers) and the MTP_LORA k trace
(mtp_trace.py), with fake servers."""

from __future__ import annotations

import json
import os
import time

import _bench_lib as lib
import bench_speculative as bench
import mtp_trace
import pytest

HOST = {"cpu_count": 2, "cpu_model": "m", "torch_version": "t", "sglang_version": "s"}


def fake_run(name: str, tok_s: float) -> dict:
    return {
        "algorithm": name,
        "output_throughput": tok_s,
        "mean_e2e_latency_ms": 1.0,
        "p99_e2e_latency_ms": 2.0,
        "mean_tpot_ms": 1000.0 / tok_s,
        "median_tpot_ms": 900.0 / tok_s,
        "mean_accept_length": None,
        "greedy_output_ids": [[1, 2]],
    }


def test_concurrency_sweep_flag() -> None:
    args, _ = lib.parse_args(["--algorithms", "none", "--concurrency", "1, 4,16"])
    assert args.concurrencies == [1, 4, 16] and args.max_concurrency == 1
    args, _ = lib.parse_args(["--algorithms", "none", "--max-concurrency", "8"])
    assert args.concurrencies == [8]
    assert lib.parse_args(["--algorithms", "none"])[0].concurrencies == [16]
    for bad, message in (
        (["--concurrency", "1,4", "--max-concurrency", "4"], "not both"),
        (["--concurrency", "1,x"], "integers"),
        (["--concurrency", "0,4"], ">= 1"),
        (["--concurrency", "4,4"], "twice"),
    ):
        with pytest.raises(lib.BenchError, match=message):
            lib.parse_args(["--algorithms", "none", *bad])


def test_parse_bench_result_keeps_the_median_tpot_when_reported() -> None:
    line = {"completed": 2, "output_throughput": 1.0, "mean_e2e_latency_ms": 1.0,
            "p99_e2e_latency_ms": 1.0, "mean_tpot_ms": 3.0, "median_tpot_ms": 2.5}  # fmt: skip
    assert lib.parse_bench_result(json.dumps(line), 2)["median_tpot_ms"] == 2.5
    runs = [{"algorithm": "a", **fake_run("a", v)} for v in (10.0, 30.0, 20.0)]
    assert lib.combine_rounds(runs)["median_tpot_ms"] == pytest.approx(45.0)


def test_sweep_drives_every_concurrency_on_servers_started_once(monkeypatch, tmp_path) -> None:
    log: list = []
    speed = {("none", 1): 10.0, ("mtp_lora_auto", 1): 9.0, ("none", 4): 20.0,
             ("mtp_lora_auto", 4): 30.0}  # fmt: skip

    class Server:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            log.append(("stop", self.name))

    def fake_start(name: str, port: int, args, extra, work) -> Server:
        log.append(("start", name))
        return Server(name)

    def fake_measure(server: Server, name: str, args, extra, work) -> dict:
        log.append((name, args.max_concurrency, f"{work.parent.name}/{work.name}"))
        if name == "mtp_lora_auto":  # what the worker writes, one line per decode step
            time.sleep(0.03)
            now, bs = time.perf_counter(), args.max_concurrency
            with open(work.parents[1] / mtp_trace.TRACE_FILE, "a") as f:
                f.write(f"{now - 0.02:.6f} 0 {bs} 5.0 Decision(k=0)\n")
                f.write(f"{now - 0.01:.6f} 2 {bs} 5.0 Decision(k=2)\n")
        return fake_run(name, speed[(name, args.max_concurrency)])

    monkeypatch.setattr(bench, "start_server", fake_start)
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "host_info", lambda: dict(HOST))
    out = tmp_path / "out.json"
    argv = ["--algorithms", "none,mtp_lora_auto", "--concurrency", "1,4", "--rounds", "2",
            "--interleave", "--max-total-tokens", "64", "--json", str(out),
            "--log-dir", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    assert log == [
        ("start", "none"),
        ("start", "mtp_lora_auto"),
        ("none", 1, "c1/round0"),
        ("mtp_lora_auto", 1, "c1/round0"),
        ("mtp_lora_auto", 1, "c1/round1"),
        ("none", 1, "c1/round1"),
        ("none", 4, "c4/round0"),
        ("mtp_lora_auto", 4, "c4/round0"),
        ("mtp_lora_auto", 4, "c4/round1"),
        ("none", 4, "c4/round1"),
        ("stop", "none"),
        ("stop", "mtp_lora_auto"),
    ]
    result = json.loads(out.read_text())
    assert result["concurrencies"] == [1, 4] and result["date"].endswith("+00:00")
    rows = {(r["algorithm"], r["max_concurrency"]): r for r in result["runs"]}
    assert list(rows) == [("none", 1), ("mtp_lora_auto", 1), ("none", 4), ("mtp_lora_auto", 4)]
    assert rows[("mtp_lora_auto", 1)]["ratios"]["output_throughput_paired"] == pytest.approx(0.9)
    assert rows[("mtp_lora_auto", 4)]["ratios"]["output_throughput_paired"] == pytest.approx(1.5)
    assert rows[("mtp_lora_auto", 4)]["median_tpot_ms"] == pytest.approx(30.0)
    assert rows[("mtp_lora_auto", 4)]["greedy_equal_baseline"] is True
    spans = [(r["t_start_s"], r["t_end_s"]) for r in rows[("none", 4)]["rounds"]]
    first_c1 = rows[("none", 1)]["rounds"][0]["t_start_s"]
    assert 0 <= first_c1 <= spans[0][0] <= spans[0][1] <= spans[1][0]
    trace = result["mtp_k_trace"]["mtp_lora_auto"]
    steps = [(s["k"], s["batch_size"], s["num_steps"]) for s in trace]
    assert steps == [(0, 1, 1), (2, 1, 1)] * 2 + [(0, 4, 1), (2, 4, 1)] * 2
    assert all(0 < s["t_start_s"] < s["t_end_s"] for s in trace)
    assert trace[-1]["t_end_s"] <= spans[1][1]  # the steps ran inside the measurement


def test_an_mtp_lora_server_gets_a_fresh_trace_file(monkeypatch, tmp_path) -> None:
    seen = []

    class FakeProcess:
        def __init__(self, flags, port, log_path) -> None:
            seen.append(os.environ.get(mtp_trace.TRACE_ENV))

        def wait_ready(self, timeout: float) -> None:
            pass

    monkeypatch.setattr(bench, "ServerProcess", FakeProcess)
    monkeypatch.delenv(mtp_trace.TRACE_ENV, raising=False)
    args, extra = lib.parse_args(["--algorithms", "none,mtp_lora,specblock"])
    stale = tmp_path / mtp_trace.TRACE_FILE
    stale.write_text("an earlier server's steps\n")
    for name in args.algorithms:
        bench.start_server(name, 1, args, extra, tmp_path)
    assert seen == [None, str(stale), None]
    assert not stale.exists() and mtp_trace.TRACE_ENV not in os.environ


def test_k_traces_read_only_their_algorithm_and_this_run(tmp_path) -> None:
    t0 = 1000.0
    for directory, lines in (
        ("1-mtp_lora", ["999.0 3 1 5.0 before t0", "1001.0 2 1 5.0 x", "1001.005 2 1 5.0"]),
        ("4-mtp_lora", ["1003.0 2 2 5.0", "1001.5 2 2 5.0", "1003.005 2 2 5.0", "1003.1 2"]),
        ("2-x-mtp_lora", ["1001.0 1 1 5.0"]),
        ("mtp_lora", ["1001.0 1 1 5.0"]),
    ):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / mtp_trace.TRACE_FILE).write_text("\n".join(lines) + "\n")
    args, _ = lib.parse_args(["--algorithms", "none,mtp_lora"])
    (trace,) = bench.k_traces(args, tmp_path, t0).values()
    assert trace == [
        {"t_start_s": 1.0, "t_end_s": 1.01, "k": 2, "batch_size": 1, "num_steps": 2},
        {"t_start_s": 1.5, "t_end_s": 1.505, "k": 2, "batch_size": 2, "num_steps": 1},
        # the same k and batch size after a pause (other servers driven): a segment of its own
        {"t_start_s": 3.0, "t_end_s": 3.01, "k": 2, "batch_size": 2, "num_steps": 2},
    ]


def test_is_mtp_lora() -> None:
    assert mtp_trace.is_mtp_lora(lib.ALGORITHMS["mtp_lora_off"].flags)
    assert mtp_trace.is_mtp_lora(["--speculative-algorithm=MTP_LORA"])
    assert not mtp_trace.is_mtp_lora(lib.ALGORITHMS["minedraft"].flags)
    assert not mtp_trace.is_mtp_lora([])
