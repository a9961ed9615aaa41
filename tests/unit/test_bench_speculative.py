"""benchmarks/bench_speculative.py: CLI, algorithm flags, result JSON and ratios (no servers),
plus one end-to-end run of its ``main`` on tiny random models."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

import _bench_lib as lib  # noqa: E402
import bench_speculative as bench  # noqa: E402

RUN_KEYS = {
    "algorithm",
    "output_throughput",
    "mean_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "mean_tpot_ms",
    "mean_accept_length",
    "greedy_equal_baseline",
    "ratios",
}
HOST_KEYS = {"cpu_count", "cpu_model", "torch_version", "sglang_version", "device"}


def fake_run(algorithm: str, throughput: float, ids: list[list[int]], accept=None) -> dict:
    return {
        "algorithm": algorithm,
        "output_throughput": throughput,
        "mean_e2e_latency_ms": 1000.0 / throughput,
        "p99_e2e_latency_ms": 2000.0 / throughput,
        "mean_tpot_ms": 100.0 / throughput,
        "mean_accept_length": accept,
        "greedy_output_ids": ids,
    }


# --- command line -------------------------------------------------------------------------


def test_parse_args_splits_known_and_pass_through_flags() -> None:
    args, extra = lib.parse_args(
        ["--algorithms", "none,standalone", "--num-prompts", "4", "--max-concurrency", "2",
         "--output-len", "8", "--model-path", "M", "--speculative-draft-model-path", "D",
         "--dtype", "float32", "--json", "out.json"]
    )  # fmt: skip
    assert args.algorithms == ["none", "standalone"]
    assert (args.num_prompts, args.max_concurrency, args.output_len) == (4, 2, 8)
    assert args.input_len == 128
    assert args.json == "out.json"
    assert extra == [
        "--model-path",
        "M",
        "--speculative-draft-model-path",
        "D",
        "--dtype",
        "float32",
    ]


def test_parse_args_does_not_swallow_abbreviations() -> None:
    _, extra = lib.parse_args(["--algorithms", "none", "--num", "3"])
    assert extra == ["--num", "3"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algorithms", "none,eagle"], "known: none, standalone"),
        (["--algorithms", "None"], "unknown algorithm(s) None"),
        (["--algorithms", "none,none"], "twice"),
        (["--algorithms", ","], "empty"),
        (["--algorithms", "none", "--port", "30000"], "--port is chosen by the benchmark"),
        (["--algorithms", "standalone", "--speculative-algorithm=EAGLE"], "set by --algorithms"),
        (["--algorithms", "none", "--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--algorithms", "none", "--rounds", "0"], "--rounds must be >= 1"),
        (["--algorithms", "none", "--interleave"], "cap it with --max-total-tokens"),
    ],
)
def test_bad_command_lines_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(lib.BenchError) as info:
        lib.parse_args(argv)
    assert message in str(info.value)


def test_unknown_algorithm_fails_before_any_server(monkeypatch, capsys) -> None:
    def no_server(*_args, **_kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(bench, "ServerProcess", no_server)
    monkeypatch.setattr(bench, "run_algorithm", no_server)
    assert bench.main(["--algorithms", "none,standalone,bogus", "--model-path", "M"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "none, standalone" in err


@pytest.fixture
def own_algorithms(monkeypatch):
    """Variants register into ALGORITHMS: give each test its own copy."""
    monkeypatch.setattr(lib, "ALGORITHMS", dict(lib.ALGORITHMS))


def test_variant_adds_flags_to_its_base_and_overrides_its_defaults(own_algorithms) -> None:
    args, extra = lib.parse_args(
        ["--algorithms", "none,specblock,sb-n8,k1-m4",
         "--variant", "sb-n8=specblock --specblock-max-nodes 8",
         "--variant", "k1-m4=specblock-k1 --specblock-m 4", "--model-path", "M"]
    )  # fmt: skip
    assert args.algorithms == ["none", "specblock", "sb-n8", "k1-m4"]
    assert "--variant" not in extra
    n8 = lib.server_flags("sb-n8", extra)
    assert n8[-4:] == ["--speculative-algorithm", "SPECBLOCK", "--specblock-max-nodes", "8"]
    assert "--specblock-max-nodes" not in lib.server_flags("specblock", extra)
    m4 = lib.server_flags("k1-m4", extra)
    assert m4.count("--specblock-m") == 1 and m4[m4.index("--specblock-m") + 1] == "4"
    assert m4[m4.index("--specblock-drafter-path") + 1].endswith("specblock-k1")
    plain = lib.register_variant("none-t2=none --max-running-requests 2")
    assert lib.server_flags(plain, ["--model-path", "M"])[-2:] == ["--max-running-requests", "2"]


def test_variant_sets_environment_for_its_server_only(own_algorithms) -> None:
    name = lib.register_variant("one-core=standalone-1core SGLSPEC_X=0 A_B=x=y --dtype float16")
    spec = lib.ALGORITHMS[name]
    assert spec.env == (("SGLANG_CPU_OMP_THREADS_BIND", "0"), ("SGLSPEC_X", "0"), ("A_B", "x=y"))
    flags = lib.server_flags(name, ["--model-path", "M"])
    assert flags[flags.index("--dtype") + 1] == "float16" and "SGLSPEC_X=0" not in flags
    assert lib.ALGORITHMS["standalone-1core"].env == (("SGLANG_CPU_OMP_THREADS_BIND", "0"),)


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("specblock --specblock-m 1", "NAME=BASE"),
        ("x=", "NAME=BASE"),
        ("specblock=specblock --specblock-m 1", "name must be new"),
        ("a,b=specblock", "name must be new"),
        ("x=eagle --specblock-m 1", "unknown base 'eagle'"),
        ("x=specblock 8", "must start with --"),
        ("x=none --speculative-num-steps 2", "none takes no --speculative-*"),
        ("x=specblock --specblock-m '1", "quotation"),
    ],
)
def test_bad_variants_are_refused(own_algorithms, variant: str, message: str) -> None:
    with pytest.raises(lib.BenchError) as info:
        lib.parse_args(["--algorithms", "none", "--variant", variant])
    assert message in str(info.value)


def test_variant_flags_cannot_also_be_passed_to_every_server(own_algorithms) -> None:
    with pytest.raises(lib.BenchError, match="set by --algorithms"):
        lib.parse_args(
            ["--algorithms", "none,x", "--variant", "x=specblock --specblock-m 1",
             "--specblock-m", "2"]
        )  # fmt: skip


# --- algorithm -> server flags ------------------------------------------------------------


def test_none_drops_every_speculative_flag_with_its_values() -> None:
    extra = ["--model-path", "M", "--speculative-draft-model-path", "D", "--dtype", "float32",
             "--speculative-num-steps=5", "--speculative-token-map", "a", "b", "--enable-x"]  # fmt: skip
    assert lib.server_flags("none", extra) == [
        "--model-path",
        "M",
        "--dtype",
        "float32",
        "--enable-x",
    ]


def test_standalone_adds_algorithm_and_chain_defaults() -> None:
    flags = lib.server_flags(
        "standalone", ["--model-path", "M", "--speculative-draft-model-path", "D"]
    )
    assert flags == [
        "--model-path", "M", "--speculative-draft-model-path", "D",
        "--speculative-algorithm", "STANDALONE_FULL",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4",
    ]  # fmt: skip


def test_user_shape_flags_win_over_defaults() -> None:
    extra = ["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens=6"]
    flags = lib.server_flags("standalone", extra)
    assert flags.count("--speculative-eagle-topk") == 1
    assert sum(f.startswith("--speculative-num-draft-tokens") for f in flags) == 1
    assert lib.flag_value(flags, "--speculative-eagle-topk") == "2"
    assert lib.flag_value(flags, "--speculative-num-draft-tokens") == "6"
    assert lib.flag_value(flags, "--speculative-num-steps") == "3"


def test_model_path_for_the_tokenizer() -> None:
    assert lib.model_path(["--dtype", "float32", "--model-path=/m"]) == "/m"
    assert lib.model_path(["--model", "/n"]) == "/n"
    assert lib.model_path([]) is None


def test_bench_serving_command_is_offline_and_fixed_length() -> None:
    args, _ = lib.parse_args(["--algorithms", "none", "--num-prompts", "4", "--output-len", "8"])
    argv = lib.bench_serving_argv(30001, args, "/m", Path("/tmp/o.jsonl"))
    assert argv[:3] == [sys.executable, "-m", "sglang.bench_serving"]
    expected = {"--dataset-name": "random-ids", "--port": "30001", "--random-input-len": "128",
                "--random-output-len": "8", "--random-range-ratio": "1.0", "--num-prompts": "4",
                "--max-concurrency": "16", "--tokenizer": "/m", "--output-file": "/tmp/o.jsonl"}  # fmt: skip
    for flag, value in expected.items():
        assert lib.flag_value(argv, flag) == value, flag
    assert not lib.has_flag(lib.bench_serving_argv(1, args, None, Path("o")), "--tokenizer")


def test_each_round_draws_its_own_prompts_and_flushes_after_the_warm_up() -> None:
    """By default round r seeds bench_serving with 1 + r and has it flush the server's caches
    after its warm-up (a request of the measured prompts); ``--repeat-prompts`` keeps the
    fixed seed and flushes nothing."""
    args, _ = lib.parse_args(["--algorithms", "none,ngram", "--rounds", "3"])
    for round_index in range(3):
        argv = lib.bench_serving_argv(1, bench.at_round(args, round_index), None, Path("o"))
        assert lib.flag_value(argv, "--seed") == str(1 + round_index)
        assert argv.count("--seed") == 1 and lib.has_flag(argv, "--flush-cache")
    repeat, _ = lib.parse_args(["--algorithms", "none", "--rounds", "3", "--repeat-prompts"])
    for round_index in range(3):
        argv = lib.bench_serving_argv(1, bench.at_round(repeat, round_index), None, Path("o"))
        assert lib.flag_value(argv, "--seed") == "1" and not lib.has_flag(argv, "--flush-cache")


@pytest.mark.parametrize("repeat", [False, True])
def test_the_greedy_check_follows_a_flush_unless_prompts_repeat(
    monkeypatch, tmp_path, repeat
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(bench, "run_bench_serving", lambda *a: calls.append("bench") or {
        "bench_accept_length": 2.0})  # fmt: skip
    monkeypatch.setattr(bench, "parse_server_metrics", lambda text: {})
    monkeypatch.setattr(bench, "flush_caches", lambda url, timeout: calls.append("flush"))
    monkeypatch.setattr(bench, "run_greedy", lambda *a: calls.append("greedy") or {
        "greedy_output_ids": [[1]], "greedy_accept_length": 3.0})  # fmt: skip
    server = types.SimpleNamespace(url="http://x", port=1, log_path=tmp_path / "server.log")
    server.log_path.write_text("")
    argv = ["--algorithms", "none"] + (["--repeat-prompts"] if repeat else [])
    args, extra = lib.parse_args(argv)
    run = bench.measure(server, "none", bench.at_round(args, 0), extra, tmp_path / "w")
    assert "error" not in run, run
    assert calls == (["bench", "greedy"] if repeat else ["bench", "flush", "greedy"])


# --- results ------------------------------------------------------------------------------


def test_parse_bench_result_reads_the_last_line() -> None:
    line = {"completed": 4, "output_throughput": 10, "mean_e2e_latency_ms": 5.0,
            "p99_e2e_latency_ms": 9.0, "mean_tpot_ms": 2.0, "accept_length": 2.5}  # fmt: skip
    text = json.dumps({"completed": 0}) + "\n" + json.dumps(line) + "\n"
    metrics = lib.parse_bench_result(text, num_prompts=4)
    assert metrics == {"output_throughput": 10.0, "mean_e2e_latency_ms": 5.0,
                       "p99_e2e_latency_ms": 9.0, "mean_tpot_ms": 2.0,
                       "bench_accept_length": 2.5}  # fmt: skip
    assert (
        lib.parse_bench_result(json.dumps({**line, "accept_length": None}), 4)[
            "bench_accept_length"
        ]
        is None
    )
    with pytest.raises(ValueError, match="completed 3/4"):
        lib.parse_bench_result(json.dumps({**line, "completed": 3}), 4)
    with pytest.raises(ValueError, match="no result"):
        lib.parse_bench_result("\n", 4)


def test_accept_length_prefers_the_benchmark_and_falls_back_to_greedy() -> None:
    assert lib.pick_accept_length(2.5, 3.0) == {
        "mean_accept_length": 2.5,
        "accept_length_source": "bench_serving",
    }
    assert lib.pick_accept_length(None, 3.0)["mean_accept_length"] == 3.0
    assert lib.pick_accept_length(None, None)["mean_accept_length"] is None


def test_assemble_greedy_equality_and_ratios() -> None:
    ids = [[1, 2, 3], [4, 5, 6]]
    runs = [fake_run("none", 10.0, ids), fake_run("standalone", 25.0, ids, 3.2)]
    runs.append(fake_run("other", 5.0, [[1, 2, 3], [4, 5, 7]]))
    result = lib_assemble(["none", "standalone", "other"], runs)
    none, standalone, other = result["runs"]
    assert none["greedy_equal_baseline"] is None
    assert standalone["greedy_equal_baseline"] is True
    assert other["greedy_equal_baseline"] is False
    assert none["ratios"] == {"output_throughput": 1.0, "mean_e2e_latency_ms": 1.0,
                              "mean_tpot_ms": 1.0, "output_throughput_paired": None,
                              "output_throughput_paired_range": None}  # fmt: skip
    assert standalone["ratios"]["output_throughput"] == pytest.approx(2.5)
    assert standalone["ratios"]["mean_e2e_latency_ms"] == pytest.approx(0.4)
    assert standalone["ratios"]["mean_tpot_ms"] == pytest.approx(0.4)
    for run in result["runs"]:
        assert RUN_KEYS <= run.keys()
        assert "greedy_output_ids" not in run
    json.dumps(result)


def test_no_greedy_verdict_against_a_speculative_reference() -> None:
    ids = [[1, 2]]
    runs = [fake_run("standalone", 10.0, ids, 2.0), fake_run("none", 5.0, ids)]
    result = lib_assemble(["standalone", "none"], runs)
    assert [r["greedy_equal_baseline"] for r in result["runs"]] == [None, None]
    assert result["runs"][1]["ratios"]["output_throughput"] == pytest.approx(0.5)


def test_failed_runs_keep_their_error_and_get_no_ratios() -> None:
    runs = [
        {"algorithm": "none", "error": "RuntimeError: boom"},
        fake_run("standalone", 4.0, [[1]]),
    ]
    result = lib_assemble(["none", "standalone"], runs)
    failed, ok = result["runs"]
    assert failed == {"algorithm": "none", "error": "RuntimeError: boom"}
    assert ok["greedy_equal_baseline"] is None
    paired = ["output_throughput_paired", "output_throughput_paired_range"]
    assert ok["ratios"] == dict.fromkeys([*lib.RATIO_METRICS, *paired])
    table = lib.format_table(result["runs"])
    assert "none: ERROR RuntimeError: boom" in table and "standalone" in table


def test_table_shows_values_and_ratios() -> None:
    ids = [[1]]
    runs = [fake_run("none", 10.0, ids), fake_run("standalone", 20.0, ids, 3.5)]
    table = lib.format_table(lib_assemble(["none", "standalone"], runs)["runs"])
    header, none, standalone = table.splitlines()
    assert header.split()[:2] == ["algorithm", "out"]
    assert none.split() == [
        "none",
        "10.00",
        "100.0",
        "200.0",
        "10.00",
        "-",
        "-",
        "-",
        "1.000",
        "1.000",
        "1.000",
        "-",
        "-",
    ]
    assert standalone.split()[-8:] == ["3.50", "-", "yes", "2.000", "0.500", "0.500", "-", "-"]


def test_server_metrics_come_from_the_last_worker_line() -> None:
    line = (
        "[2026-11-23 10:00:00] SPECBLOCK: steps={} mean_accept_length={} "
        "drafter_forwards_per_iter=3.00 T_D%={} mean_tree_nodes=20.1 alpha_k=[0.90,-] "
        "mean_step_ms=80.00"
    )
    log = "\n".join(["boot", line.format(50, "2.500", "40.0"), line.format(100, "2.750", "38.5")])
    assert lib.parse_server_metrics(log + "\nshutdown") == {
        "draft_share_pct": 38.5,
        "drafter_forwards_per_iter": 3.0,
        "server_accept_length": 2.75,
        "server_mean_step_ms": 80.0,
    }
    assert lib.parse_server_metrics("no worker metrics here\n") == {}
    rounds = [{**fake_run("specblock", 10.0, [[1]]), "draft_share_pct": v} for v in (30, 40, 50)]
    assert lib.combine_rounds(rounds)["draft_share_pct"] == 40
    plain = lib.combine_rounds([fake_run("none", 10.0, [[1]]), fake_run("none", 12.0, [[1]])])
    assert "draft_share_pct" not in plain


def test_specblock_k1_uses_the_k1_drafter_at_the_same_depth() -> None:
    flags = lib.server_flags("specblock-k1", ["--speculative-num-steps", "3"])
    assert flags[flags.index("--specblock-drafter-path") + 1].endswith("specblock-k1")
    assert flags[flags.index("--specblock-m") + 1] == "8"
    assert "--speculative-num-steps" not in flags
    mine = lib.server_flags("specblock-k1", ["--specblock-m", "4"])
    assert mine.count("--specblock-m") == 1 and mine[mine.index("--specblock-m") + 1] == "4"


def test_main_writes_json_and_fails_when_a_run_failed(monkeypatch, tmp_path) -> None:
    fakes = {
        "none": fake_run("none", 10.0, [[1]]),
        "standalone": {"algorithm": "standalone", "error": "x"},
    }
    monkeypatch.setattr(bench, "run_algorithm", lambda i, name, *_: dict(fakes[name]))
    monkeypatch.setattr(bench, "host_info", lambda: dict.fromkeys(HOST_KEYS, "h"))
    out = tmp_path / "out.json"
    argv = ["--algorithms", "none,standalone", "--json", str(out), "--log-dir", str(tmp_path)]
    assert bench.main(argv) == 1
    result = json.loads(out.read_text())
    assert "--algorithms none,standalone" in result["command"]
    assert [r["algorithm"] for r in result["runs"]] == ["none", "standalone"]
    fakes["standalone"] = fake_run("standalone", 20.0, [[1]], 2.0)
    assert bench.main(argv) == 0


def test_rounds_alternate_order_and_take_the_median(monkeypatch, tmp_path) -> None:
    assert lib.round_orders(["a", "b", "c"], 3) == [
        ["a", "b", "c"],
        ["c", "b", "a"],
        ["a", "b", "c"],
    ]
    visits, speed = [], {"none": iter([10.0, 14.0, 12.0]), "standalone": iter([30.0, 20.0, 22.0])}

    def fake(index: int, name: str, *_args) -> dict:
        visits.append((index, name))
        return fake_run(name, next(speed[name]), [[1, 2]], None if name == "none" else 2.0)

    monkeypatch.setattr(bench, "run_algorithm", fake)
    monkeypatch.setattr(bench, "host_info", lambda: dict.fromkeys(HOST_KEYS, "h"))
    out = tmp_path / "out.json"
    argv = ["--algorithms", "none,standalone", "--rounds", "3", "--json", str(out)]
    assert bench.main([*argv, "--log-dir", str(tmp_path)]) == 0
    assert visits == [
        (0, "none"),
        (1, "standalone"),
        (3, "standalone"),
        (2, "none"),
        (4, "none"),
        (5, "standalone"),
    ]
    none, standalone = json.loads(out.read_text())["runs"]
    assert (none["output_throughput"], standalone["output_throughput"]) == (12.0, 22.0)
    assert standalone["ratios"]["output_throughput"] == pytest.approx(22.0 / 12.0)
    assert standalone["greedy_equal_baseline"] is True
    assert [r["output_throughput"] for r in standalone["rounds"]] == [30.0, 20.0, 22.0]


def test_a_round_with_other_greedy_ids_breaks_equality() -> None:
    runs = [fake_run("standalone", 1.0, [[1]], 2.0), fake_run("standalone", 1.0, [[2]], 2.0)]
    combined = lib.combine_rounds(runs)
    assert combined["greedy_rounds_equal"] is False
    result = lib_assemble(["none", "standalone"], [fake_run("none", 1.0, [[1]]), combined])
    assert result["runs"][1]["greedy_equal_baseline"] is False
    failed = lib.combine_rounds([runs[0], {"algorithm": "standalone", "error": "boom"}])
    assert failed == {"algorithm": "standalone", "error": "boom"}


def test_paired_ratio_cancels_drift_between_rounds() -> None:
    # the host halves its speed in rounds 2 and 3; within each round b is 0.95 x a
    a = [{"output_throughput": v} for v in (100.0, 50.0, 50.0)]
    b = [{"output_throughput": 0.95 * v} for v in (100.0, 50.0, 50.0)]
    b[0]["output_throughput"] = 95.0
    assert lib.paired_ratio(b, a, "output_throughput") == pytest.approx(0.95)
    assert lib.paired_ratio(b[:2], a, "output_throughput") is None
    assert lib.paired_ratio(None, a, "output_throughput") is None
    assert lib.paired_ratio([{"output_throughput": None}], a[:1], "output_throughput") is None
    runs = [lib.combine_rounds([fake_run("none", r["output_throughput"], [[1]]) for r in a])]
    runs.append(lib.combine_rounds([fake_run("b", r["output_throughput"], [[1]]) for r in b]))
    lib.add_ratios(runs)
    assert runs[1]["ratios"]["output_throughput_paired"] == pytest.approx(0.95)
    assert runs[1]["ratios"]["output_throughput_paired_range"] == pytest.approx([0.95, 0.95])


def test_paired_range_shows_the_spread_of_the_rounds() -> None:
    """The table says how far the rounds' paired ratios spread, next to their median."""
    a = [{"output_throughput": v} for v in (100.0, 100.0, 100.0)]
    b = [{"output_throughput": v} for v in (80.0, 100.0, 130.0)]
    assert lib.paired_ratios(b, a, "output_throughput") == pytest.approx([0.8, 1.0, 1.3])
    rounds = [
        [fake_run("none", r["output_throughput"], [[1]]) for r in a],
        [fake_run("b", r["output_throughput"], [[1]]) for r in b],
    ]
    result = lib_assemble(["none", "b"], [lib.combine_rounds(one) for one in rounds])
    runs = result["runs"]
    assert runs[1]["ratios"]["output_throughput_paired"] == pytest.approx(1.0)
    assert runs[1]["ratios"]["output_throughput_paired_range"] == pytest.approx([0.8, 1.3])
    table = lib.format_table(runs)
    assert "paired min-max" in table.splitlines()[0]
    assert table.splitlines()[2].split()[-2:] == ["1.000", "0.80-1.30"]


def test_interleave_needs_a_pool_cap_and_sleeps_idle_servers() -> None:
    args, extra = lib.parse_args(
        ["--algorithms", "none", "--interleave", "--max-total-tokens", "9"]
    )
    assert args.interleave and extra == ["--max-total-tokens", "9"]
    assert lib.interleave_flags(extra) == ["--max-total-tokens", "9", "--sleep-on-idle"]
    assert lib.interleave_flags(["--sleep-on-idle"]) == ["--sleep-on-idle"]
    args, _ = lib.parse_args(["--algorithms", "none", "--interleave", "--mem-fraction-static=0.3"])
    assert args.interleave
    assert lib.parse_args(["--algorithms", "none"])[0].interleave is False


class FakeServer:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def stop(self) -> None:
        self.log.append(("stop", self.name))


def test_interleave_starts_each_server_once_and_drives_them_in_turn(monkeypatch, tmp_path) -> None:
    log: list = []
    speed = {"none": iter([10.0, 5.0, 10.0]), "mtp_lora_auto": iter([10.0, 5.0, 9.0])}

    def fake_start(name: str, port: int, args, extra, work) -> FakeServer:
        assert "--sleep-on-idle" in extra and work.is_dir()
        if name == "standalone":
            raise RuntimeError("no draft model")
        log.append(("start", name))
        return FakeServer(name, log)

    def fake_measure(server: FakeServer, name: str, args, extra, work) -> dict:
        assert server.name == name and "--sleep-on-idle" not in extra
        assert work.name == f"round{args.round_index}"  # each round its own prompts
        log.append(("measure", name, work.name))
        return fake_run(name, next(speed[name]), [[1]])

    monkeypatch.setattr(bench, "start_server", fake_start)
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "host_info", lambda: dict.fromkeys(HOST_KEYS, "h"))
    out = tmp_path / "out.json"
    argv = ["--algorithms", "none,standalone,mtp_lora_auto", "--rounds", "3", "--interleave",
            "--max-total-tokens", "4096", "--json", str(out), "--log-dir", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 1  # standalone never started
    assert log == [
        ("start", "none"),
        ("start", "mtp_lora_auto"),
        ("measure", "none", "round0"),
        ("measure", "mtp_lora_auto", "round0"),
        ("measure", "mtp_lora_auto", "round1"),
        ("measure", "none", "round1"),
        ("measure", "none", "round2"),
        ("measure", "mtp_lora_auto", "round2"),
        ("stop", "none"),
        ("stop", "mtp_lora_auto"),
    ]
    none, standalone, auto = json.loads(out.read_text())["runs"]
    assert standalone["error"].startswith("server start: no draft model")
    assert auto["ratios"]["output_throughput"] == pytest.approx(0.9)  # medians 9 / 10
    assert auto["ratios"]["output_throughput_paired"] == pytest.approx(1.0)  # 1, 1, 0.9
    assert auto["greedy_equal_baseline"] is True


def test_interleave_stops_every_server_when_a_round_raises(monkeypatch, tmp_path) -> None:
    log: list = []
    monkeypatch.setattr(bench, "start_server", lambda name, *_: FakeServer(name, log))

    def interrupted(*_args) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "measure", interrupted)
    argv = ["--algorithms", "none,mtp_lora_auto", "--interleave", "--max-total-tokens", "64",
            "--log-dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    assert log == [("stop", "none"), ("stop", "mtp_lora_auto")]


def lib_assemble(algorithms: list[str], runs: list[dict]) -> dict:
    return lib.assemble("cmd", {}, algorithms, runs)


# --- end to end ---------------------------------------------------------------------------


@pytest.mark.server
def test_end_to_end_none_vs_standalone(tiny_models, tmp_path, monkeypatch, capsys) -> None:
    """The benchmark's ``main`` in this process, its servers started like the tests' (forked
    from the preloaded launcher), its ``sglang.bench_serving`` runs as subprocesses."""
    from tests.helpers.server_utils import PreloadedServerProcess

    monkeypatch.setattr(bench, "ServerProcess", PreloadedServerProcess)
    out = tmp_path / "out.json"
    argv = [
        "--algorithms", "none,standalone", "--num-prompts", "4", "--max-concurrency", "2",
        "--output-len", "8", "--input-len", "16", "--json", str(out),
        "--log-dir", str(tmp_path / "logs"), "--timeout", "420",
        "--model-path", str(tiny_models["target"]),
        "--speculative-draft-model-path", str(tiny_models["draft"]),
        "--dtype", "float32", "--mem-fraction-static", "0.05", "--max-total-tokens", "16384",
        "--skip-server-warmup",
    ]  # fmt: skip
    code = bench.main(argv)
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-4000:]
    result = json.loads(out.read_text())
    assert set(result) >= {"command", "host", "runs"}
    assert HOST_KEYS <= result["host"].keys()
    none, standalone = result["runs"]
    assert (none["algorithm"], standalone["algorithm"]) == ("none", "standalone")
    for run in (none, standalone):
        assert RUN_KEYS <= run.keys(), run
        assert run["output_throughput"] > 0
        assert run["mean_e2e_latency_ms"] > 0 and run["mean_tpot_ms"] > 0
    assert none["mean_accept_length"] is None
    assert none["greedy_equal_baseline"] is None
    assert standalone["mean_accept_length"] >= 1.0
    assert standalone["greedy_equal_baseline"] is True
    assert none["ratios"]["output_throughput"] == 1.0
    assert "standalone" in stdout and "x tok/s" in stdout


def test_none_without_model_path_names_the_default_target() -> None:
    """With no --model-path the launcher would turn STANDALONE on: the 'none' baseline must not
    speculate, so the harness names the default target explicitly."""
    from sgl_spec.models.registry import DEFAULT_TARGET

    flags = lib.server_flags("none", [])
    assert flags == ["--model-path", DEFAULT_TARGET]
    assert lib.server_flags("none", ["--model-path", "m"]) == ["--model-path", "m"]


def test_minedraft_metrics_and_one_core_variants(monkeypatch) -> None:
    import os

    line = (
        "[2026-11-23 10:00:00] MINEDRAFT: steps=200 parallel_steps=190 coverage=0.950"
        " mean_accept_length=2.300 draft_ms=55.00 verify_ms=350.00 overlap_ms=54.00"
        " wait_ms=0.50 overlap_bound=1.157 undrafted=3 faults=1 restarts=1 balance=0 moved=0"
    )
    metrics = lib.parse_server_metrics(line)
    assert metrics["coverage"] == 0.95 and metrics["overlap_bound"] == 1.157
    assert metrics["server_accept_length"] == 2.3 and metrics["draft_server_faults"] == 1
    flags = lib.server_flags("minedraft", ["--model-path", "m"])
    assert flags[flags.index("--speculative-draft-device") + 1] == "cpu:1"
    mine = lib.server_flags("minedraft", ["--model-path", "m", "--speculative-draft-device", "cpu"])
    assert mine.count("--speculative-draft-device") == 1
    sequential = lib.server_flags("minedraft-sequential", ["--model-path", "m"])
    assert sequential[sequential.index("--minedraft-overlap") + 1] == "off"
    assert sequential[sequential.index("--speculative-draft-device") + 1] == "cpu:1"
    hosted = lib.server_flags("minedraft-specblock", ["--model-path", "m"])
    assert hosted[hosted.index("--minedraft-drafter") + 1] == "specblock"
    assert hosted[hosted.index("--speculative-num-steps") + 1] == "4"
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    with lib.algorithm_env("standalone-1core"):
        assert os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "0"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ
    with lib.algorithm_env("none"):
        assert "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ


def test_step_profile_buckets_stacks_by_their_frames() -> None:
    import step_profile

    base = "run_scheduler_process (scheduler.py:1);Scheduler.run_batch (scheduler.py:2)"
    model = "LlamaForCausalLM.forward (llama.py:611);Linear.forward (linear.py:9)"
    raw = "\n".join(
        [
            f"{base};SpecBlockWorker.forward_decode (w.py:1);verify_trees (t.py:1);{model} 6",
            f"{base};SpecBlockWorker._draft (w.py:2);SpecBlockDrafter.forward (m.py:3) 3",
            f"{base};SpecBlockWorker._draft (w.py:2);grow_trees (d.py:4) 1",
            # the drafter's extend after the verify is drafting too, not the target's forward
            f"{base};SpecBlockWorker.forward_decode (w.py:1);DrafterFollowing._follow (f.py:1);"
            "DrafterFollowing._drafter_extend (f.py:2);SpecBlockDrafter.forward (m.py:3) 4",
            f"{base};SpecBlockWorker.forward_decode (w.py:1);DrafterFollowing._follow (f.py:1);"
            "DrafterKVPool.write (k.py:1) 2",
            f"{base};Scheduler.process_batch_result (scheduler.py:3) 2",
            "garbage line without a count",
        ]
    )
    out = step_profile.summarise(raw)
    assert out["samples"] == 18
    assert out["shares"] == {
        "target fwd": 6 / 18, "draft fwd": 7 / 18, "draft other": 3 / 18, "around": 2 / 18,
    }  # fmt: skip
    assert out["around_top"] == [("Scheduler.process_batch_result (scheduler.py:3)", 2 / 18)]
    assert "| specblock | 18 | 33.3% | 38.9% | 16.7% | 11.1% |" in step_profile.format_table(
        {"specblock": out}
    )
