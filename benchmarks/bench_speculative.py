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
"""

from __future__ import annotations

import argparse
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

import requests
from _bench_lib import (
    BenchError,
    algorithm_env,
    assemble,
    bench_serving_argv,
    combine_rounds,
    format_table,
    host_info,
    mean_or_none,
    model_path,
    parse_args,
    parse_bench_result,
    parse_server_metrics,
    pick_accept_length,
    round_orders,
    server_flags,
)

from sgl_spec.server_process import ServerProcess, pick_port, tail

NUM_GREEDY_PROMPTS = 8
MAX_GREEDY_NEW_TOKENS = 64
MAX_GREEDY_PROMPT_LEN = 32
# Token ids of the greedy prompts: below 250 so that any real vocabulary (and the tests' tiny
# 512-token one) holds them, above 10 to skip the usual special tokens.
GREEDY_TOKEN_RANGE = (10, 250)


def greedy_prompts(input_len: int) -> list[list[int]]:
    """The same prompts for every algorithm and every invocation (seeded)."""
    rng = random.Random(0)
    length = min(input_len, MAX_GREEDY_PROMPT_LEN)
    return [
        [rng.randrange(*GREEDY_TOKEN_RANGE) for _ in range(length)]
        for _ in range(NUM_GREEDY_PROMPTS)
    ]


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


def run_algorithm(
    index: int, algorithm: str, args: argparse.Namespace, extra: list[str], log_dir: Path
) -> dict:
    """Serve, benchmark and stop one algorithm; any failure becomes ``run["error"]``."""
    run: dict = {"algorithm": algorithm}
    work = log_dir / f"{index}-{algorithm}"
    work.mkdir(parents=True, exist_ok=True)
    run["log_dir"] = str(work)
    port = pick_port(args.port_base + index)
    print(f"[{algorithm}] starting server on port {port} (logs {work})", flush=True)
    server, stage = None, "server start"
    try:
        with algorithm_env(algorithm):
            server = ServerProcess(server_flags(algorithm, extra), port, work / "server.log")
        started = time.monotonic()
        server.wait_ready(args.timeout)
        print(f"[{algorithm}] ready in {time.monotonic() - started:.0f}s", flush=True)
        stage = "bench_serving"
        run.update(run_bench_serving(port, args, model_path(extra), work))
        run.update(parse_server_metrics(server.log_path.read_text(errors="replace")))
        stage = "greedy /generate"
        prompts = greedy_prompts(args.input_len)
        max_new_tokens = min(args.output_len, MAX_GREEDY_NEW_TOKENS)
        run.update(run_greedy(server.url, prompts, max_new_tokens, args.timeout))
        run.update(pick_accept_length(run["bench_accept_length"], run["greedy_accept_length"]))
    except Exception as exc:  # noqa: BLE001 - one failed run must not stop the others
        run["error"] = f"{stage}: {type(exc).__name__}: {exc}"
        if server is not None and server.proc.poll() is not None:
            run["error"] += (
                f"\nserver exited with code {server.proc.returncode}:\n{tail(server.log_path)}"
            )
        print(f"[{algorithm}] FAILED: {run['error']}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
    return run


def main(argv: list[str]) -> int:
    try:
        args, extra = parse_args(argv)
    except BenchError as exc:
        print(f"bench_speculative.py: error: {exc}", file=sys.stderr)
        return 2
    command = shlex.join([sys.executable, os.path.relpath(__file__), *argv])
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_speculative_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    per_algorithm: dict[str, list[dict]] = {name: [] for name in args.algorithms}
    for round_i, order in enumerate(round_orders(args.algorithms, args.rounds)):
        for name in order:
            index = round_i * len(args.algorithms) + args.algorithms.index(name)
            per_algorithm[name].append(run_algorithm(index, name, args, extra, log_dir))
    runs = [combine_rounds(per_algorithm[name]) for name in args.algorithms]
    result = assemble(command, host_info(), args.algorithms, runs)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(command)
    print(f"host: {json.dumps(result['host'])}")
    print(f"ratios x = run / {args.algorithms[0]}; greedy= : greedy ids equal the first run's")
    if args.rounds > 1:
        print(f"metrics: median over {args.rounds} rounds (order alternates)")
    print(format_table(result["runs"]))
    return 1 if any("error" in run for run in runs) else 0


def exit_on_sigterm() -> None:
    """``kill`` (SIGTERM) exits through ``finally`` like Ctrl-C does, so the running server
    (its own process group) is stopped instead of left holding its KV pool."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main(sys.argv[1:]))
