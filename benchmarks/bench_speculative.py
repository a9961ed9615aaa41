"""Side-by-side serving benchmark of speculative decoding algorithms.

    .venv/bin/python benchmarks/bench_speculative.py --algorithms none,standalone \\
        --num-prompts 64 --max-concurrency 16 --output-len 128 --json out.json \\
        --model-path M --speculative-draft-model-path D

For each algorithm in turn: start ``python -m sgl_spec.launch_server`` (the public command) with
the pass-through flags plus the algorithm's own, wait for ``/health_generate``, drive it with
``sglang.bench_serving`` on the offline ``random-ids`` dataset, send one batch of fixed greedy
requests (token ids and ``meta_info.spec_accept_length``), stop it. All runs happen in one
invocation on one host, so the ratios against the first algorithm compare like with like
(DESIGN.md: speed is measured side by side, never by timed asserts).

Each round draws prompts of its own (bench_serving's seed plus the round; with ``--prompts
code``, windows that never overlap), and each server's caches are flushed (``/flush_cache``)
after bench_serving's warm-up and before the greedy check: no pass meets anything a server
kept from before it (in a ``--concurrency`` sweep the rounds of each concurrency repeat the
prompts of the one before, but every pass starts flushed). SGLang's NGRAM keeps every output
in its corpus, and with the same prompts every round it replays them (``--repeat-prompts``:
the protocol of runs before 2026-12-07, kept to reproduce them).

``--rounds R`` repeats that with the order alternating; ``--interleave`` instead starts every
server once, keeps them all up (idle ones sleep) and drives them in turn each round, which on
a host whose speed drifts gives the steadier comparison (``x tok/s paired``: the median over
rounds of each round's ratio). It needs a KV pool cap, e.g. ``--max-total-tokens 65536``.

``--concurrency 1,4,16`` sweeps: the whole comparison, every round, at each concurrency in turn
(with ``--interleave`` on the same servers, started once). The JSON's rows name their
``max_concurrency``, ratios are within a concurrency, and each row (or round) records when it
ran (``t_start_s``/``t_end_s``, seconds since the start). An MTP_LORA server writes its
worker's per-step trace, stored as ``mtp_k_trace`` (its k over time, ``mtp_trace.py``);
``plot_results.py`` draws the figures.

``hf`` and ``hf-assisted`` in ``--algorithms`` are peers that start no server: Hugging Face
transformers ``generate`` on the same target, plain and with ``assistant_model=`` the draft,
batch 1, each measurement in a fresh process on bench_serving's own prompts (``hf_peer.py``).
With ``--interleave`` a peer runs in its turn while the servers sleep idle. The fastest server's
throughput over each peer's is printed after the table and stored as ``peer_comparison``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bench_lib
import code_prompts
import hf_peer
import mtp_trace
import requests
from _bench_lib import (
    TOKEN_RANGE,
    BenchError,
    algorithm_env,
    assemble,
    bench_serving_argv,
    combine_rounds,
    format_table,
    fresh_prompts,
    host_info,
    interleave_flags,
    mean_or_none,
    model_path,
    parse_args,
    parse_bench_result,
    parse_server_metrics,
    pick_accept_length,
    round_orders,
    server_flags,
)
from _bracket import Brackets, bracketed_order
from server_process import ServerProcess, pick_port, tail

NUM_GREEDY_PROMPTS = 8
MAX_GREEDY_NEW_TOKENS = 64
MAX_GREEDY_PROMPT_LEN = 32
FLUSH_TIMEOUT_S = 60.0  # bench_serving's own --flush-cache timeout
# --interleave: server i listens at or above --port-base + PORT_STRIDE * i
PORT_STRIDE = 10


def greedy_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The same prompts for every algorithm and every invocation: random tokens (seeded), or
    with ``--prompts code`` the starts of the first code windows."""
    length = min(args.input_len, MAX_GREEDY_PROMPT_LEN)
    windows = getattr(args, "code_windows", None)
    if windows is not None:
        return [windows[i % len(windows)][:length] for i in range(NUM_GREEDY_PROMPTS)]
    rng = random.Random(0)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(NUM_GREEDY_PROMPTS)]


def prepare_prompts(args: argparse.Namespace, extra: list[str], log_dir: Path) -> None:
    """With ``--prompts code``: write bench_serving's datasets of code windows
    (``code_prompts``), one per round unless ``--repeat-prompts``, and keep round 0's token ids
    for the greedy check (``args.dataset_paths``, ``args.dataset_path`` = round 0's,
    ``args.code_windows``)."""
    if args.prompts != "code":
        return
    from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path

    tokenizer = resolve_model_path(model_path(extra) or DEFAULT_TARGET)
    rounds = args.rounds if fresh_prompts(args) else 1
    per_round = code_prompts.code_window_rounds(
        tokenizer, args.num_prompts, args.input_len, args.output_len, rounds
    )
    args.dataset_paths = [
        code_prompts.write_dataset(log_dir / code_prompts.dataset_file(r), texts)
        for r, (texts, _) in enumerate(per_round)
    ]
    args.dataset_path = args.dataset_paths[0]
    args.code_windows = per_round[0][1]


def at_round(args: argparse.Namespace, round_index: int) -> argparse.Namespace:
    """``args`` for one round: its index (bench_serving's seed) and, with ``--prompts code``,
    its dataset."""
    round_args = argparse.Namespace(**{**vars(args), "round_index": round_index})
    paths = getattr(args, "dataset_paths", None)
    if paths and fresh_prompts(args):
        round_args.dataset_path = paths[round_index]
    return round_args


def flush_caches(url: str, timeout: float) -> None:
    """SGLang's ``/flush_cache`` (radix cache, KV pools, a drafter's own caches such as NGRAM's
    corpus), waiting up to ``timeout`` for the server to go idle."""
    resp = requests.post(url + "/flush_cache", params={"timeout": timeout}, timeout=timeout + 30)
    if resp.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {resp.status_code}: {resp.text.strip()}")


def run_bench_serving(port: int, args: argparse.Namespace, model: str | None, work: Path) -> dict:
    """One ``sglang.bench_serving`` run; returns the metrics of its output file."""
    out_file, log_path = work / "bench_serving.jsonl", work / "bench_serving.log"
    cmd = bench_serving_argv(port, args, model, out_file)
    with open(log_path, "w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"bench_serving timed out after {args.timeout:.0f}s") from exc
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(
            f"bench_serving failed with code {proc.returncode} (log {log_path}):\n{tail(log_path)}"
        )
    try:
        return parse_bench_result(out_file.read_text(), args.num_prompts)
    except ValueError as exc:
        raise RuntimeError(f"{exc} (log {log_path})") from exc


def run_greedy(url: str, prompts: list[list[int]], max_new_tokens: int, timeout: float) -> dict:
    """One batched /generate at temperature 0: token ids and mean accept length per request."""
    payload = {
        "input_ids": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    resp = requests.post(url + "/generate", json=payload, timeout=timeout)
    resp.raise_for_status()
    outputs = resp.json()
    return {
        "greedy_output_ids": [o["output_ids"] for o in outputs],
        "greedy_accept_length": mean_or_none(
            [o["meta_info"].get("spec_accept_length") for o in outputs]
        ),
    }


def start_server(
    algorithm: str, port: int, args: argparse.Namespace, extra: list[str], work: Path
) -> ServerProcess:
    """Start one algorithm's server and wait until it answers ``/health_generate``; the caller
    stops it (also when this raises: the half-started server is stopped here)."""
    print(f"[{algorithm}] starting server on port {port} (logs {work})", flush=True)
    trace_env = {}
    if mtp_trace.is_mtp_lora(_bench_lib.ALGORITHMS[algorithm].flags):
        trace = work / mtp_trace.TRACE_FILE
        trace.unlink(missing_ok=True)  # the worker appends
        trace_env[mtp_trace.TRACE_ENV] = str(trace)
    with algorithm_env(algorithm, trace_env):
        server = ServerProcess(server_flags(algorithm, extra), port, work / "server.log")
    started = time.monotonic()
    try:
        server.wait_ready(args.timeout)
    except BaseException:
        server.stop()
        raise
    print(f"[{algorithm}] ready in {time.monotonic() - started:.0f}s", flush=True)
    return server


def measure(
    server: ServerProcess, algorithm: str, args: argparse.Namespace, extra: list[str], work: Path
) -> dict:
    """One ``bench_serving`` run and the fixed greedy batch against a ready server; any
    failure becomes ``run["error"]``."""
    run: dict = {"algorithm": algorithm, "log_dir": str(work)}
    work.mkdir(parents=True, exist_ok=True)
    stage = "bench_serving"
    try:
        run.update(run_bench_serving(server.port, args, model_path(extra), work))
        run.update(parse_server_metrics(server.log_path.read_text(errors="replace")))
        if fresh_prompts(args):
            stage = "/flush_cache"
            flush_caches(server.url, FLUSH_TIMEOUT_S)
        stage = "greedy /generate"
        prompts = greedy_prompts(args)
        max_new_tokens = min(args.output_len, MAX_GREEDY_NEW_TOKENS)
        run.update(run_greedy(server.url, prompts, max_new_tokens, args.timeout))
        run.update(pick_accept_length(run["bench_accept_length"], run["greedy_accept_length"]))
    except Exception as exc:
        run["error"] = f"{stage}: {type(exc).__name__}: {exc}"
        if server.proc.poll() is not None:
            run["error"] += (
                f"\nserver exited with code {server.proc.returncode}:\n{tail(server.log_path)}"
            )
        print(f"[{algorithm}] FAILED: {run['error']}", file=sys.stderr, flush=True)
    return run


def is_peer(algorithm: str) -> bool:
    """A transformers peer (no server)? Looked up at call time: variants register later."""
    return _bench_lib.ALGORITHMS[algorithm].peer


def measure_hf(algorithm: str, args: argparse.Namespace, extra: list[str], work: Path) -> dict:
    """One measurement of a transformers peer (``hf``, ``hf-assisted``) in a fresh process,
    with the greedy prompts the servers get; any failure becomes ``run["error"]``."""
    greedy_new_tokens = min(args.output_len, MAX_GREEDY_NEW_TOKENS)
    prompts = greedy_prompts(args)
    return hf_peer.measure_peer(algorithm, args, extra, work, prompts, greedy_new_tokens)


def run_algorithm(
    index: int, algorithm: str, args: argparse.Namespace, extra: list[str], log_dir: Path
) -> dict:
    """Serve, benchmark and stop one algorithm (or measure one peer); any failure becomes
    ``run["error"]``."""
    work = log_dir / f"{index}-{algorithm}"
    work.mkdir(parents=True, exist_ok=True)
    if is_peer(algorithm):
        return measure_hf(algorithm, args, extra, work)
    try:
        server = start_server(algorithm, pick_port(args.port_base + index), args, extra, work)
    except Exception as exc:
        print(f"[{algorithm}] FAILED: server start: {exc}", file=sys.stderr, flush=True)
        return {"algorithm": algorithm, "log_dir": str(work), "error": f"server start: {exc}"}
    try:
        return measure(server, algorithm, args, extra, work)
    finally:
        server.stop()


# concurrency -> algorithm -> its runs, one per round
Sweep = dict[int, dict[str, list[dict]]]


def at_concurrency(args: argparse.Namespace, concurrency: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "max_concurrency": concurrency})


def timed(started: float, measure_fn, *fn_args) -> dict:
    """``measure_fn(*fn_args)``, stamped with when it ran (seconds since ``started``)."""
    begin = time.perf_counter()
    run = measure_fn(*fn_args)
    run["t_start_s"] = round(begin - started, 3)
    run["t_end_s"] = round(time.perf_counter() - started, 3)
    return run


def run_sequential(
    args: argparse.Namespace, extra: list[str], log_dir: Path, started: float
) -> Sweep:
    """A fresh server per algorithm, round and concurrency, one at a time."""
    sweep: Sweep = {}
    for ci, concurrency in enumerate(args.concurrencies):
        args_c = at_concurrency(args, concurrency)
        per_algorithm: dict[str, list[dict]] = {name: [] for name in args.algorithms}
        for round_i, order in enumerate(round_orders(args.algorithms, args.rounds)):
            for name in order:
                index = (ci * args.rounds + round_i) * len(args.algorithms)
                index += args.algorithms.index(name)
                args_r = at_round(args_c, round_i)
                run = timed(started, run_algorithm, index, name, args_r, extra, log_dir)
                per_algorithm[name].append(run)
        sweep[concurrency] = per_algorithm
    return sweep


def run_interleaved(
    args: argparse.Namespace, extra: list[str], log_dir: Path, started: float
) -> Sweep:
    """Every algorithm's server up at once (idle ones sleep), each round driving them in turn.

    A slow spell of the host then falls on neighbouring runs of every algorithm alike instead
    of on whichever server happened to be up, and server start-up effects (first-touch pages,
    calibration) are paid once; the paired ratios compare each round's runs. A sweep drives
    every round of one concurrency before the next.
    """
    servers: dict[str, ServerProcess] = {}
    failed: dict[str, str] = {}
    sweep: Sweep = {}
    try:
        for i, name in enumerate(args.algorithms):
            if is_peer(name):
                continue  # no server: a fresh process in each of its turns
            work = log_dir / f"{i}-{name}"
            work.mkdir(parents=True, exist_ok=True)
            port = pick_port(args.port_base + PORT_STRIDE * i)
            try:
                servers[name] = start_server(name, port, args, interleave_flags(extra), work)
            except Exception as exc:
                failed[name] = f"server start: {exc}"
                print(f"[{name}] FAILED: {failed[name]}", file=sys.stderr, flush=True)
        for concurrency in args.concurrencies:
            sweep[concurrency] = drive_round_robin(
                args, extra, log_dir, started, concurrency, servers, failed
            )
    finally:
        for server in servers.values():
            server.stop()
    return sweep


def drive_round_robin(
    args: argparse.Namespace,
    extra: list[str],
    log_dir: Path,
    started: float,
    concurrency: int,
    servers: dict[str, ServerProcess],
    failed: dict[str, str],
) -> dict[str, list[dict]]:
    """Every round at one concurrency against the running servers: algorithm -> its runs."""
    args_c = at_concurrency(args, concurrency)
    is_sweep = len(args.concurrencies) > 1
    reference = args.algorithms[0]
    bracket = getattr(args, "bracket", False) and reference not in failed
    per_algorithm: dict[str, list[dict]] = {name: [] for name in args.algorithms}
    for round_i, order in enumerate(round_orders(args.algorithms, args.rounds)):
        args_r = at_round(args_c, round_i)
        brackets = Brackets(reference)
        sequence = bracketed_order(order, reference) if bracket else order
        for name in sequence:
            if name in failed:
                per_algorithm[name].append({"algorithm": name, "error": failed[name]})
                continue
            again = len(per_algorithm[name]) > round_i  # a bracketing run of the reference
            work = log_dir / f"{args.algorithms.index(name)}-{name}"
            work = work / f"c{concurrency}" if is_sweep else work
            work = work / (f"round{round_i}" + (f"-{brackets.count}" if again else ""))
            where = f"concurrency {concurrency}, " if is_sweep else ""
            print(f"[{name}] {where}round {round_i + 1}/{args.rounds}", flush=True)
            if is_peer(name):
                run = timed(started, measure_hf, name, args_r, extra, work)
            else:
                run = timed(started, measure, servers[name], name, args_r, extra, work)
            brackets.ran(name, run)
            if not again:
                per_algorithm[name].append(run)
    return per_algorithm


def k_traces(args: argparse.Namespace, log_dir: Path, started: float) -> dict[str, list[dict]]:
    """Each MTP_LORA algorithm's k over time from its servers' traces (``mtp_trace.py``)."""
    traces = {}
    for name in args.algorithms:
        if not mtp_trace.is_mtp_lora(_bench_lib.ALGORITHMS[name].flags):
            continue
        paths = []
        for path in log_dir.glob(f"*/{mtp_trace.TRACE_FILE}"):
            index, _, server_name = path.parent.name.partition("-")
            if index.isdigit() and server_name == name:
                paths.append(path)
        if paths:
            traces[name] = mtp_trace.read_segments(paths, started)
    return traces


def main(argv: list[str]) -> int:
    try:
        args, extra = parse_args(argv)
    except BenchError as exc:
        print(f"bench_speculative.py: error: {exc}", file=sys.stderr)
        return 2
    command = shlex.join([sys.executable, os.path.relpath(__file__), *argv])
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_speculative_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    prepare_prompts(args, extra, log_dir)
    run = run_interleaved if args.interleave else run_sequential
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    started = time.perf_counter()
    sweep = run(args, extra, log_dir, started)
    result = {"command": command, "host": host_info(), "date": date}
    result.update(concurrencies=args.concurrencies, runs=[])
    comparison = []
    for concurrency, per_algorithm in sweep.items():
        runs = [
            hf_peer.combine_peer_rounds(combine_rounds(per_algorithm[name]), per_algorithm[name])
            for name in args.algorithms
        ]
        part = assemble(command, result["host"], args.algorithms, runs)
        result["runs"] += [
            {"algorithm": run["algorithm"], "max_concurrency": concurrency, **run}
            for run in part["runs"]
        ]
        comparison += hf_peer.peer_comparison(part["runs"])
    if comparison:
        result["peer_comparison"] = comparison
    traces = k_traces(args, log_dir, started)
    if traces:
        result["mtp_k_trace"] = traces
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(command)
    print(f"host: {json.dumps(result['host'])}")
    print(f"ratios x = run / {args.algorithms[0]}; greedy= : greedy ids equal the first run's")
    if args.rounds > 1:
        print(f"metrics: median over {args.rounds} rounds (order alternates)")
        print("x tok/s paired: median over rounds of run / first run of the same round;")
        print("paired min-max: the lowest and highest of those per-round ratios")
    if getattr(args, "bracket", False):
        print(f"x bracketed: median over rounds of run / mean of the {args.algorithms[0]} runs")
        print("just before and after it (--bracket); its min-max likewise")
    if args.interleave:
        print("servers: all up at once (--interleave), idle ones sleeping")
    for concurrency in args.concurrencies:
        if len(args.concurrencies) > 1:
            print(f"\nmax concurrency {concurrency}")
        print(format_table([r for r in result["runs"] if r["max_concurrency"] == concurrency]))
    print_peer_notes(args, comparison)
    return 1 if any("error" in run for run in result["runs"]) else 0


def print_peer_notes(args: argparse.Namespace, comparison: list[dict]) -> None:
    """What the transformers peers are, and the fastest server against each."""
    peers = [name for name in args.algorithms if is_peer(name)]
    if not peers:
        return
    print(
        f"{', '.join(peers)}: transformers generate, batch 1, requests one after another "
        f"(servers: concurrency {','.join(map(str, args.concurrencies))}); "
        "accept = tokens / target forwards"
    )
    for line in hf_peer.format_comparison(comparison):
        print(f"fastest server vs peer: {line}")


def exit_on_sigterm() -> None:
    """``kill`` (SIGTERM) exits through ``finally`` like Ctrl-C does, so the running server
    (its own process group) is stopped instead of left holding its KV pool."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main(sys.argv[1:]))
