"""One request at a time, alternating between servers: paired per-request speed ratios.

    .venv/bin/python benchmarks/bench_alternate.py --algorithms none,specblock,sb_old \\
        [--variant 'sb_old=specblock ENV=...'] --num-prompts 32 --rounds 2 \\
        --output-len 128 --input-len 128 --max-total-tokens 16384 [--json OUT] [-- flags]

``bench_speculative.py --interleave`` drives each server through a whole ``bench_serving`` run
(tens of seconds) before the next; on a shared host whose speed drifts over tens of seconds
its rounds of one server spread by up to 0.6x, which buries a 3-5% difference at one request.
Here every server is up at once (idle ones sleep) and each prompt goes to every server in turn,
one greedy request at a time (``ignore_eos``: every server generates the same number of
tokens), the order rotating from prompt to prompt. A drift then falls on the requests of one
prompt alike, and each algorithm's ratio is the geometric mean over prompts of the first
algorithm's request time over its own, with a 95% bootstrap interval over the prompts. Each
request is timed end to end by the client (its prefill included). Every round draws new random
prompts, so no server meets a prompt its radix cache holds. Greedy outputs are compared with
the first algorithm's, prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import requests
from _bench_lib import TOKEN_RANGE, host_info, interleave_flags, parse_args
from bench_speculative import PORT_STRIDE, start_server
from server_process import ServerProcess, pick_port

BOOTSTRAP_SAMPLES = 2000


def visit_order(names: list[str], visit: int) -> list[str]:
    """The servers in the order request ``visit`` goes to them: rotated by one each visit, so
    every server goes first, second, ... equally often over ``len(names)`` visits."""
    shift = visit % len(names)
    return names[shift:] + names[:shift]


def paired_ratio(reference: list[float], times: list[float], seed: int = 0) -> dict:
    """Geometric mean over pairs of ``reference[i] / times[i]`` (> 1: faster than the
    reference) and its 95% bootstrap interval (pairs resampled with replacement)."""
    if len(reference) != len(times) or not times:
        raise ValueError("paired_ratio needs the same positive number of times on both sides")
    logs = [math.log(r / t) for r, t in zip(reference, times, strict=True)]
    rng = random.Random(seed)
    means = sorted(
        sum(rng.choice(logs) for _ in logs) / len(logs) for _ in range(BOOTSTRAP_SAMPLES)
    )
    low, high = means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]
    return {
        "ratio": math.exp(sum(logs) / len(logs)),
        "ci95": [math.exp(low), math.exp(high)],
        "pairs": len(logs),
    }


def generate(url: str, prompt: list[int], output_len: int, timeout: float) -> dict:
    """One greedy request; its client-side wall time, output ids and accept length."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True},
    }
    started = time.perf_counter()
    resp = requests.post(url + "/generate", json=body, timeout=timeout)
    elapsed = time.perf_counter() - started
    resp.raise_for_status()
    out = resp.json()
    return {
        "seconds": elapsed,
        "output_ids": out["output_ids"],
        "accept_length": out["meta_info"].get("spec_accept_length"),
    }


def drive(args: argparse.Namespace, servers: dict[str, ServerProcess]) -> dict[str, list[dict]]:
    """Every round's prompts through every server, one request at a time, in rotating order."""
    names = list(servers)
    results: dict[str, list[dict]] = {name: [] for name in names}
    visit = 0
    for round_i in range(args.rounds):
        rng = random.Random(1000 + round_i)
        for p in range(args.num_prompts):
            prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(args.input_len)]
            for name in visit_order(names, visit):
                run = generate(servers[name].url, prompt, args.output_len, args.timeout)
                results[name].append({"round": round_i, "prompt": p, **run})
            visit += 1
        print(f"round {round_i + 1}/{args.rounds} done", flush=True)
    return results


def summarise(results: dict[str, list[dict]], base: str | None = None) -> dict[str, dict]:
    """Per algorithm: tokens a second over all its requests, the paired ratio to ``base``
    (default the first algorithm), the mean accept length, and how many outputs differ from
    the first algorithm's."""
    names = list(results)
    reference = results[names[0]]
    timing = results[base or names[0]]
    rows = {}
    for name in names:
        runs = results[name]
        tokens = sum(len(r["output_ids"]) for r in runs)
        accepts = [r["accept_length"] for r in runs if r["accept_length"] is not None]
        rows[name] = {
            "tok_per_s": tokens / sum(r["seconds"] for r in runs),
            **paired_ratio([r["seconds"] for r in timing], [r["seconds"] for r in runs]),
            "accept_length": sum(accepts) / len(accepts) if accepts else None,
            "outputs_differing": sum(
                a["output_ids"] != b["output_ids"] for a, b in zip(reference, runs, strict=True)
            ),
        }
    return rows


def format_rows(rows: dict[str, dict], base: str | None = None) -> str:
    base = base or next(iter(rows))
    lines = [f"{'algorithm':18s} {'tok/s':>8s} {'accept':>7s}  x {base} (95% CI)  differ"]
    for name, r in rows.items():
        accept = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        low, high = r["ci95"]
        lines.append(
            f"{name:18s} {r['tok_per_s']:8.2f} {accept:>7s}  {r['ratio']:.3f} "
            f"({low:.3f}-{high:.3f})  {r['outputs_differing']}/{r['pairs']}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--reference", default=None, help="the ratios' base (default: the first)")
    ours, argv = own.parse_known_args(argv)
    if "--concurrency" not in argv and "--max-concurrency" not in argv:
        argv = [*argv, "--max-concurrency", "1"]
    args, extra = parse_args(argv)
    if ours.reference is not None and ours.reference not in args.algorithms:
        raise SystemExit(f"--reference {ours.reference} is not one of --algorithms")
    if any(c != 1 for c in args.concurrencies):
        raise SystemExit("bench_alternate.py drives one request at a time (--concurrency 1)")
    log_dir = Path(args.log_dir or "/tmp/sgl_spec_bench_alternate")
    servers: dict[str, ServerProcess] = {}
    try:
        for i, name in enumerate(args.algorithms):
            work = log_dir / f"{i}-{name}"
            work.mkdir(parents=True, exist_ok=True)
            port = pick_port(args.port_base + PORT_STRIDE * i)
            servers[name] = start_server(name, port, args, interleave_flags(extra), work)
        results = drive(args, servers)
    finally:
        for server in servers.values():
            server.stop()
    rows = summarise(results, ours.reference)
    print(format_rows(rows, ours.reference))
    if args.json:
        out = {"command": [sys.executable, *sys.argv], "host": host_info(), "rows": rows}
        out["requests"] = {
            name: [{k: v for k, v in r.items() if k != "output_ids"} for r in runs]
            for name, runs in results.items()
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
