"""benchmarks/hf_peer.py: the Hugging Face transformers peers ``hf`` / ``hf-assisted`` of
bench_speculative.py. Parsing, metrics and failure handling without a model, then one real run
of the worker on the tiny random models."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

import _bench_lib as lib  # noqa: E402
import bench_speculative as bench  # noqa: E402
import hf_peer  # noqa: E402
import hf_peer_worker  # noqa: E402

HOST = {"cpu_count": 2}


def worker_result(tokens: list[int], assisted: bool, target_forwards: int = 10) -> dict:
    """What the worker writes: one request per entry of ``tokens``, 1 s each, TTFT 0.1 s."""
    requests = [
        {"input_tokens": 16, "output_tokens": n, "ttft_s": 0.1, "e2e_s": 1.0} for n in tokens
    ]
    assistant = {"num_assistant_tokens": 20} if assisted else None
    return {
        "requests": requests,
        "duration_s": 2.0 * len(tokens),
        "target_forwards": target_forwards,
        "draft_forwards": 40 if assisted else 0,
        "greedy_output_ids": [[1, 2]],
        "peer": {"batch_size": 1, "assistant": assistant, "torch_threads": 2},
    }


def fake_server_run(name: str, throughput: float) -> dict:
    return {
        "algorithm": name,
        "output_throughput": throughput,
        "mean_e2e_latency_ms": 1000.0 / throughput,
        "p99_e2e_latency_ms": 2000.0 / throughput,
        "mean_tpot_ms": 100.0 / throughput,
        "mean_accept_length": None,
        "greedy_output_ids": [[1, 2]],
    }


def fake_peer_run(name: str, throughput: float) -> dict:
    run = fake_server_run(name, throughput)
    run.update(mean_ttft_ms=5.0, peer={"batch_size": 1, "server_max_concurrency": 1})
    return run


class FakeServer:
    def stop(self) -> None:
        pass


# --- command line -------------------------------------------------------------------------


def test_peers_are_algorithms_without_a_server() -> None:
    args, extra = lib.parse_args(["--algorithms", "none,hf,hf-assisted", "--model-path", "M"])
    assert args.algorithms == ["none", "hf", "hf-assisted"]
    assert lib.ALGORITHMS["hf"].peer and lib.ALGORITHMS["hf-assisted"].peer
    assert not lib.ALGORITHMS["none"].peer
    # plain HF greedy is a non-speculative reference for the greedy= column; assisted is not
    assert lib.is_reference_baseline(["hf", "none"])
    assert not lib.is_reference_baseline(["hf-assisted", "none"])
    assert set(hf_peer.ASSISTED) == {n for n, a in lib.ALGORITHMS.items() if a.peer}


def test_a_peer_cannot_be_a_variant_base(monkeypatch) -> None:
    monkeypatch.setattr(lib, "ALGORITHMS", dict(lib.ALGORITHMS))
    with pytest.raises(lib.BenchError, match="runs no server"):
        lib.parse_args(["--algorithms", "none", "--variant", "x=hf --dtype float32"])
    # the benchmark looks peers up at call time, so it sees variants registered later
    lib.register_variant("none-t2=none --max-running-requests 2")
    assert not bench.is_peer("none-t2") and bench.is_peer("hf-assisted")


def test_peer_spec_resolves_the_shipped_models_and_bench_servings_seed() -> None:
    from sgl_spec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model_path

    args, extra = lib.parse_args(["--algorithms", "hf-assisted", "--output-len", "8"])
    spec = hf_peer.peer_spec("hf-assisted", args, extra, [[11, 12]], 8)
    assert spec["target"] == resolve_model_path(DEFAULT_TARGET)
    assert spec["draft"] == resolve_model_path(DEFAULT_DRAFT)
    assert (spec["seed"], spec["range_ratio"], spec["output_len"]) == (1, 1.0, 8)
    assert hf_peer.peer_spec("hf", args, extra, [], 8)["draft"] is None


def test_peer_cores_follow_sglangs_binding() -> None:
    assert hf_peer_worker.peer_cores({}, {1, 0}) == [0, 1]
    assert hf_peer_worker.peer_cores({"SGLANG_CPU_OMP_THREADS_BIND": "all"}, {0, 1}) == [0, 1]
    bind = {"SGLANG_CPU_OMP_THREADS_BIND": "0-2,5|6-7"}
    assert hf_peer_worker.peer_cores(bind, {0}) == [0, 1, 2, 5]


# --- results ------------------------------------------------------------------------------


def test_metrics_from_constructed_timings() -> None:
    requests = [
        {"output_tokens": 10, "ttft_s": 0.1 * k, "e2e_s": 1.0 * k, "input_tokens": 4}
        for k in (1, 2, 3)
    ]
    metrics = hf_peer.request_metrics(requests, duration_s=6.5)
    assert metrics["output_throughput"] == pytest.approx(30 / 6.5)
    assert metrics["mean_e2e_latency_ms"] == pytest.approx(2000.0)
    assert metrics["p99_e2e_latency_ms"] == pytest.approx(2980.0)  # numpy's linear percentile
    assert metrics["mean_ttft_ms"] == pytest.approx(200.0)
    # (e2e - ttft) / (tokens - 1): 0.1, 0.2, 0.3 s
    assert metrics["mean_tpot_ms"] == pytest.approx(200.0)
    one_token = [{"output_tokens": 1, "ttft_s": 0.5, "e2e_s": 0.5}]
    assert hf_peer.request_metrics(one_token, 1.0)["mean_tpot_ms"] is None
    assert hf_peer.percentile([5.0], 99) == 5.0


def test_parse_peer_result_accept_length_and_refusals() -> None:
    assisted = hf_peer.parse_peer_result(json.dumps(worker_result([8, 8], True, 4)), 2, 8)
    assert assisted["mean_accept_length"] == pytest.approx(16 / 4)
    assert assisted["accept_length_source"] == "target_forwards"
    assert assisted["output_throughput"] == pytest.approx(16 / 4.0)
    assert assisted["peer"]["target_forwards"] == 4 and assisted["peer"]["input_tokens"] == 32
    assert assisted["greedy_output_ids"] == [[1, 2]]
    plain = hf_peer.parse_peer_result(json.dumps(worker_result([8, 8], False, 16)), 2, 8)
    assert plain["mean_accept_length"] is None
    with pytest.raises(ValueError, match="completed 1/2"):
        hf_peer.parse_peer_result(json.dumps(worker_result([8], False)), 2, 8)
    with pytest.raises(ValueError, match=r"generated \[7\] tokens, not 8"):
        hf_peer.parse_peer_result(json.dumps(worker_result([8, 7], False)), 2, 8)


def test_comparison_names_the_fastest_server_and_the_concurrency() -> None:
    runs = [fake_server_run("none", 10.0), fake_server_run("standalone", 30.0)]
    runs += [fake_peer_run("hf-assisted", 20.0), {"algorithm": "hf", "error": "x"}]
    (row,) = hf_peer.peer_comparison(runs)
    assert (row["peer"], row["best_server"], row["ratio"]) == ("hf-assisted", "standalone", 1.5)
    assert row["ratio_paired"] is None
    assert "1.500x" in hf_peer.format_comparison([row])[0]
    row["server_max_concurrency"] = 4
    assert "not the concurrency-1 setting" in hf_peer.format_comparison([row])[0]
    assert hf_peer.peer_comparison([fake_peer_run("hf", 1.0)]) == []


# --- failures and the two modes -----------------------------------------------------------


def failing_worker(monkeypatch) -> None:
    code = "import sys; print('worker boom'); sys.exit(3)"
    monkeypatch.setattr(hf_peer, "worker_argv", lambda *_: [sys.executable, "-c", code])


def test_a_failing_worker_becomes_the_runs_error(monkeypatch, tmp_path) -> None:
    failing_worker(monkeypatch)
    args, extra = lib.parse_args(["--algorithms", "hf", "--num-prompts", "2"])
    run = bench.measure_hf("hf", args, extra, tmp_path / "w")
    assert run["algorithm"] == "hf"
    assert "code 3" in run["error"] and "worker boom" in run["error"]
    missing = bench.measure_hf("hf", args, ["--model-path", str(tmp_path / "nope")], tmp_path)
    assert "does not exist" in missing["error"]


@pytest.mark.parametrize("interleave", [False, True])
def test_a_failing_peer_does_not_stop_the_servers(monkeypatch, tmp_path, interleave) -> None:
    failing_worker(monkeypatch)
    started, measured = [], []

    def fake_start(name: str, *_args) -> FakeServer:
        started.append(name)
        return FakeServer()

    def fake_measure(server, name: str, *_args) -> dict:
        measured.append(name)
        return fake_server_run(name, 10.0)

    monkeypatch.setattr(bench, "start_server", fake_start)
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "host_info", lambda: dict(HOST))
    out = tmp_path / "out.json"
    argv = ["--algorithms", "none,hf,standalone", "--json", str(out), "--log-dir", str(tmp_path)]
    if interleave:
        argv += ["--interleave", "--max-total-tokens", "64"]
    assert bench.main(argv) == 1
    assert started == measured == ["none", "standalone"]  # the peer started no server
    none, hf, standalone = json.loads(out.read_text())["runs"]
    assert hf["error"].startswith("hf peer: RuntimeError: worker failed with code 3")
    assert "ratios" in none and "ratios" in standalone


@pytest.mark.parametrize("order", [["hf", "none", "standalone"], ["none", "hf", "standalone"]])
def test_paired_ratio_with_a_peer_first_or_not(monkeypatch, tmp_path, order, capsys) -> None:
    speed = {"none": iter([10.0, 5.0]), "standalone": iter([30.0, 15.0]), "hf": iter([20.0, 5.0])}
    visits = []

    def fake_measure_hf(name: str, args, extra, work) -> dict:
        visits.append((name, work.name))
        return fake_peer_run(name, next(speed[name]))

    monkeypatch.setattr(bench, "start_server", lambda *_: FakeServer())
    monkeypatch.setattr(bench, "measure", lambda s, n, *_: fake_server_run(n, next(speed[n])))
    monkeypatch.setattr(bench, "measure_hf", fake_measure_hf)
    monkeypatch.setattr(bench, "host_info", lambda: dict(HOST))
    out = tmp_path / "out.json"
    argv = ["--algorithms", ",".join(order), "--rounds", "2", "--interleave",
            "--max-total-tokens", "64", "--json", str(out), "--log-dir", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    assert visits == [("hf", "round0"), ("hf", "round1")]
    result = json.loads(out.read_text())
    runs = {run["algorithm"]: run for run in result["runs"]}
    first = runs[order[0]]["rounds"]
    expected = sorted(runs["standalone"]["rounds"][r]["output_throughput"]
                      / first[r]["output_throughput"] for r in (0, 1))  # fmt: skip
    paired = runs["standalone"]["ratios"]["output_throughput_paired"]
    assert paired == pytest.approx(sum(expected) / 2)
    assert runs["hf"]["peer"]["batch_size"] == 1 and runs["hf"]["mean_ttft_ms"] == 5.0
    (row,) = result["peer_comparison"]
    assert row["best_server"] == "standalone" and row["ratio"] == pytest.approx(22.5 / 12.5)
    assert row["ratio_paired"] == pytest.approx(2.25)  # rounds: 30 / 20, 15 / 5
    assert "fastest server vs peer: standalone" in capsys.readouterr().out


# --- the real worker ----------------------------------------------------------------------


def test_worker_on_tiny_models_plain_and_assisted(tiny_models, tmp_path) -> None:
    """Two requests of 8 tokens per peer, each in its own process; assisted generation keeps
    plain greedy's ids."""
    args = argparse.Namespace(
        num_prompts=2, input_len=16, output_len=8, max_concurrency=1, timeout=120.0
    )
    extra = ["--model-path", str(tiny_models["target"]),
             "--speculative-draft-model-path", str(tiny_models["draft"])]  # fmt: skip
    runs = {name: bench.measure_hf(name, args, extra, tmp_path / name) for name in hf_peer.ASSISTED}
    for run in runs.values():
        assert "error" not in run, run.get("error")
        assert run["output_throughput"] > 0 and run["mean_tpot_ms"] > 0
        assert run["peer"]["torch_threads"] == len(os.sched_getaffinity(0))
        assert [len(ids) for ids in run["greedy_output_ids"]] == [8] * bench.NUM_GREEDY_PROMPTS
    plain, assisted = runs["hf"], runs["hf-assisted"]
    assert plain["greedy_output_ids"] == assisted["greedy_output_ids"]
    assert plain["peer"]["target_forwards"] == 2 * 8  # one forward per token
    assert 1.0 <= assisted["mean_accept_length"] <= 8
    assert assisted["peer"]["assistant"]["num_assistant_tokens"] == 20
