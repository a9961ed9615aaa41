"""SPECBLOCK with and without cost-aware adaptation (``--specblock-adapt``, paper §3.4) on one
prompt stream from a domain the drafter was not trained on, in one run.

The stream is natural-language text built locally (no downloads): excerpts of the license texts
under ``/usr/share/common-licenses`` and of the installed packages' license files, falling back
to a seeded generator of English sentences. The same stream is served ``2 * --rounds`` times,
one fresh server at a time (a 2-core host cannot run two fairly): SPECBLOCK as given
(*no-adapt*) and the same flags plus ``--specblock-adapt`` (*adapt*, starting from the shipped
weights each time), in the order no-adapt, adapt, adapt, no-adapt, ... so that a host whose
speed drifts during the run favours neither. Requests are sent one after another (batch size 1,
as the paper measures), so every request is one *query* of the bandit.

Prints, per window of ``--window`` queries: the mean acceptance length tau of each kind of run
(over its rounds) and the throughput ratio adapt / no-adapt (output tokens per second of the
queries' wall time, pooled over the rounds); then the totals, each run's own totals, whether
all greedy outputs are identical (they must be: adaptation only changes drafts), and each
adapt server's last SPECBLOCK metrics line (bandit counts, v_head/v_full, updates, rollbacks).

    python benchmarks/bench_specblock_adapt.py --model-path TARGET \\
        --specblock-drafter-path DRAFTER --num-prompts 400 --max-new-tokens 256 [SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
from server_process import ServerProcess, pick_port, tail

LICENSE_DIRS = (Path("/usr/share/common-licenses"),)
WORDS = (
    "the river morning village people history small garden letter winter friend question story"
    " old city quiet road evening mother light window music language between across remember"
    " travel season harvest market bridge mountain children teacher kitchen summer autumn"
).split()


def _license_texts() -> list[str]:
    texts = []
    for folder in LICENSE_DIRS:
        if folder.is_dir():
            texts += [p.read_text(errors="ignore") for p in sorted(folder.iterdir()) if p.is_file()]
    for p in sorted(Path(sys.prefix).glob("lib/python3*/site-packages/*.dist-info/LICENSE*")):
        texts.append(p.read_text(errors="ignore"))
    return [t for t in texts if len(t) > 2000]


def _sentences(rng: random.Random, count: int) -> str:
    out = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


def build_stream(num_prompts: int, prompt_chars: int, seed: int = 0) -> list[str]:
    """``num_prompts`` natural-language excerpts of about ``prompt_chars`` characters."""
    rng = random.Random(seed)
    texts = [t for t in _license_texts() if len(t) > prompt_chars + 1]
    prompts = []
    for _ in range(num_prompts):
        if texts:
            text = rng.choice(texts)
            start = rng.randrange(0, len(text) - prompt_chars)
            prompts.append(" ".join(text[start : start + prompt_chars].split()))
        else:
            prompts.append(_sentences(rng, max(prompt_chars // 60, 1))[:prompt_chars])
    return prompts


def serve_stream(flags: list[str], prompts: list[str], args: argparse.Namespace, log: Path):
    """Per query: (output ids, acceptance length, completion time) and the log's last metrics."""
    server = ServerProcess(flags, pick_port(), log)
    try:
        server.wait_ready(args.timeout)
        records = []
        params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
        for prompt in prompts:
            tic = time.perf_counter()
            resp = requests.post(
                server.url + "/generate",
                json={"text": prompt, "sampling_params": params},
                timeout=args.timeout,
            )
            resp.raise_for_status()
            out = resp.json()
            meta = out["meta_info"]
            records.append(
                (out["output_ids"], meta.get("spec_accept_length"), time.perf_counter() - tic)
            )
    finally:
        server.stop()
    lines = [x for x in tail(log, 2000, 2000).splitlines() if "SPECBLOCK: steps=" in x]
    return records, (lines[-1] if lines else "")


def _pooled(runs: list[list]) -> tuple[float, float]:
    """(mean tau, output tokens per second of wall time) over the queries of ``runs``."""
    queries = [r for run in runs for r in run]
    tokens = sum(len(r[0]) for r in queries)
    seconds = sum(r[2] for r in queries)
    return statistics.fmean(r[1] or 1.0 for r in queries), tokens / max(seconds, 1e-9)


def window_table(base: list[list], adapt: list[list], window: int) -> list[dict]:
    """Per window of queries: the mean tau of each kind of run and the adapt / no-adapt
    throughput ratio, each pooled over that kind's runs (one list of records per run)."""
    rows = []
    for start in range(0, len(base[0]), window):
        b = [run[start : start + window] for run in base]
        a = [run[start : start + window] for run in adapt]
        (tau_b, tp_b), (tau_a, tp_a) = _pooled(b), _pooled(a)
        rows.append(
            {
                "queries": f"{start}-{start + len(b[0]) - 1}",
                "tau_no_adapt": tau_b,
                "tau_adapt": tau_a,
                "tp_no_adapt": tp_b,
                "tp_adapt": tp_a,
                "tp_ratio": tp_a / max(tp_b, 1e-9),
            }
        )
    return rows


def run_order(rounds: int) -> list[bool]:
    """Which runs use ``--specblock-adapt``: no-adapt, adapt, then mirrored (ABBA...)."""
    return [bool((i + i // 2) % 2) for i in range(2 * rounds)]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--prompt-chars", type=int, default=600)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--window", type=int, default=20, help="queries per reported window")
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of each kind, in ABBA order (default 2)"
    )
    parser.add_argument("--adapt-options", default=None, help="--specblock-adapt-options value")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args, extra = parser.parse_known_args(argv)
    sizes = (args.num_prompts, args.prompt_chars, args.max_new_tokens, args.window, args.rounds)
    if min(sizes) < 1:
        parser.error(
            "--num-prompts, --prompt-chars, --max-new-tokens, --window, --rounds must be >= 1"
        )
    if "--specblock-drafter-path" not in extra or "--model-path" not in extra:
        parser.error("pass the server's --model-path and --specblock-drafter-path")
    if "--specblock-adapt" in extra:
        parser.error("do not pass --specblock-adapt: the script runs with and without it")
    return args, extra


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_specblock_adapt_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    prompts = build_stream(args.num_prompts, args.prompt_chars)
    base_flags = [*extra, "--speculative-algorithm", "SPECBLOCK", "--log-level", "info"]
    adapt_flags = [*base_flags, "--specblock-adapt"]
    if args.adapt_options:
        adapt_flags += ["--specblock-adapt-options", args.adapt_options]
    print(f"{len(prompts)} natural-language prompts; logs in {log_dir}", flush=True)
    base: list[list] = []
    adapt: list[list] = []
    metrics: list[str] = []
    per_run = []
    for i, use_adapt in enumerate(run_order(args.rounds)):
        name = f"{i}_{'adapt' if use_adapt else 'no_adapt'}"
        records, line = serve_stream(
            adapt_flags if use_adapt else base_flags, prompts, args, log_dir / f"{name}.log"
        )
        (adapt if use_adapt else base).append(records)
        if use_adapt:
            metrics.append(line)
        tau, tp = _pooled([records])
        per_run.append({"run": name, "tau": tau, "tp": tp})
        print(f"run {name}: tau {tau:.3f}, {tp:.1f} tok/s", flush=True)
    rows = window_table(base, adapt, args.window)
    print(f"{'queries':>12} {'tau no-adapt':>12} {'tau adapt':>10} {'tp ratio':>9}")
    for row in rows:
        print(
            f"{row['queries']:>12} {row['tau_no_adapt']:>12.3f} {row['tau_adapt']:>10.3f}"
            f" {row['tp_ratio']:>9.3f}"
        )
    total = window_table(base, adapt, len(prompts))[0]
    outputs = [[r[0] for r in run] for run in base + adapt]
    same = all(o == outputs[0] for o in outputs)
    print(
        f"total: tau {total['tau_no_adapt']:.3f} -> {total['tau_adapt']:.3f},"
        f" throughput {total['tp_no_adapt']:.1f} -> {total['tp_adapt']:.1f} tok/s"
        f" (ratio {total['tp_ratio']:.3f}); greedy outputs identical: {same}"
    )
    for line in metrics:
        print(f"adapt server: {line}")
    if args.json:
        result = {
            "command": " ".join(sys.argv),
            "windows": rows,
            "total": total,
            "runs": per_run,
            "identical": same,
            "metrics": metrics,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
