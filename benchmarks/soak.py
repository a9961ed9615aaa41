"""Soak benchmark: each algorithm's server under minutes of mixed traffic, then idle.

    .venv/bin/python benchmarks/soak.py --minutes 10 --concurrency 8 --json soak.json

For each algorithm in turn (``--algorithms``, default every one on the shipped models) the
public launcher is started; a warm-up of mixed requests runs, the server goes idle, and its
idle KV usage (``/v1/loads``: tokens held with the radix cache's evictable ones counted free)
and the resident memory (RSS) of every process of the server -- launcher, scheduler,
detokenizer, MINEDRAFT's draft server -- are taken. Then ``--minutes`` of mixed traffic at
``--concurrency``: random prompt lengths (some sharing a prefix, so the radix cache holds
and evicts), random output lengths, greedy and sampled, streaming and not, and a share
(``--abort-share``, 5%) aborted mid-stream, half by closing the connection and half by
``/abort_request``. The server goes idle again and the same figures are taken.

The run of an algorithm passes when no request failed, the idle KV usage is back to its
starting value (no leaked KV slot) and no process's RSS (nor their sum) grew by
``--max-rss-growth`` (5%) or more since the warm-up. Exits non-zero unless every algorithm
passed. Unknown flags go to every server, as with ``bench_speculative.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests
from _bench_lib import TOKEN_RANGE, algorithm_env, host_info, server_flags
from server_process import ServerProcess, pick_port

DEFAULT_ALGORITHMS = ("none", "standalone", "mtp_lora", "specblock", "minedraft")
NUM_SHARED_PREFIXES, SHARED_PREFIX_SHARE = 4, 0.3
ABORT_MODES = ("disconnect", "abort_request")


@dataclass(frozen=True)
class RequestSpec:
    """One request of the mix; ``abort`` ends it after ``abort_after`` streamed chunks."""

    rid: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float  # 0: greedy
    stream: bool
    abort: str | None = None  # None or one of ABORT_MODES (always streamed)
    abort_after: int = 0

    def payload(self) -> dict:
        params = {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens}
        if self.temperature > 0:
            params["top_p"] = 0.95
        return {
            "input_ids": list(self.input_ids),
            "rid": self.rid,
            "stream": self.stream,
            "sampling_params": params,
        }


def traffic(
    seed: int, max_prompt_len: int, max_output_len: int, abort_share: float, prefix: str = "soak"
) -> Iterator[RequestSpec]:
    """An endless, seeded request mix (module docstring)."""
    rng = random.Random(seed)
    shared = [
        tuple(rng.randrange(*TOKEN_RANGE) for _ in range(max(1, max_prompt_len // 2)))
        for _ in range(NUM_SHARED_PREFIXES)
    ]
    for i in itertools.count():
        length = rng.randint(1, max_prompt_len)
        head = rng.choice(shared)[:length] if rng.random() < SHARED_PREFIX_SHARE else ()
        tail = tuple(rng.randrange(*TOKEN_RANGE) for _ in range(length - len(head)))
        abort = rng.choice(ABORT_MODES) if rng.random() < abort_share else None
        yield RequestSpec(
            rid=f"<{prefix}-{seed}-{i}>",  # SGLang aborts every rid the aborted one begins
            input_ids=head + tail,
            max_new_tokens=rng.randint(1, max_output_len),
            temperature=rng.choice((0.0, 0.7, 1.0)),
            stream=abort is not None or rng.random() < 0.5,
            abort=abort,
            abort_after=rng.randint(1, 4) if abort else 0,
        )


@dataclass
class Outcome:
    """What one request returned. ``ok``: served as asked (an aborted one: ended, whether by
    the abort or by finishing first); ``finish``: SGLang's finish reason type."""

    rid: str
    ok: bool
    finish: str | None = None
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None
    max_gap_s: float = 0.0  # longest wait between two streamed chunks
    aborted: bool = False  # the abort was sent (or the connection closed) before the end
    accept_length: float | None = None  # meta_info.spec_accept_length (speculative servers)


def _judge(spec: RequestSpec, outcome: Outcome) -> Outcome:
    if outcome.error is None and not (outcome.aborted and spec.abort == "disconnect"):
        normal = outcome.finish in ("length", "stop")
        sized = 0 < len(outcome.output_ids) <= spec.max_new_tokens
        outcome.ok = (normal and sized) or (outcome.aborted and outcome.finish == "abort")
        if not outcome.ok:
            outcome.error = f"finish {outcome.finish}, {len(outcome.output_ids)} tokens"
    return outcome


def send(url: str, spec: RequestSpec, timeout: float = 600.0) -> Outcome:
    """Send ``spec`` and read the answer, aborting it as the spec says; never raises."""
    outcome = Outcome(spec.rid, ok=False)
    try:
        with requests.post(
            url + "/generate", json=spec.payload(), stream=spec.stream, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                outcome.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            elif spec.stream:
                _read_stream(url, spec, resp, outcome)
            else:
                _take(outcome, resp.json())
    except (requests.RequestException, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    if spec.abort == "disconnect" and outcome.aborted and outcome.error is None:
        outcome.ok = True  # nothing more to read: the server must abort it on its own
    return _judge(spec, outcome)


def _read_stream(url: str, spec: RequestSpec, resp, outcome: Outcome) -> None:
    chunks, last = 0, None
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        now = time.monotonic()
        if last is not None:
            outcome.max_gap_s = max(outcome.max_gap_s, now - last)
        last = now
        _take(outcome, json.loads(line[6:]))
        chunks += 1
        if outcome.finish is None and spec.abort and chunks == spec.abort_after:
            outcome.aborted = True
            if spec.abort == "disconnect":
                return  # leaving the with-block closes the connection
            requests.post(url + "/abort_request", json={"rid": spec.rid}, timeout=60)


def _take(outcome: Outcome, body: dict) -> None:
    if "error" in body:
        outcome.error = str(body["error"])[:200]
        return
    outcome.output_ids = list(body.get("output_ids") or [])
    meta = body.get("meta_info", {})
    outcome.accept_length = meta.get("spec_accept_length")
    reason = meta.get("finish_reason")
    outcome.finish = reason.get("type") if isinstance(reason, dict) else reason


def drive(
    url: str, specs: Iterator[RequestSpec], concurrency: int, seconds: float, timeout: float
) -> list[tuple[RequestSpec, Outcome]]:
    """``concurrency`` clients, each sending the next spec as soon as its last one ended,
    until ``seconds`` have passed (requests in flight then are finished, not cut)."""
    lock, done = threading.Lock(), []
    deadline = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                spec = next(specs)
            outcome = send(url, spec, timeout)
            with lock:
                done.append((spec, outcome))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done


def tally(results: list[tuple[RequestSpec, Outcome]]) -> dict:
    """Counts over a traffic run (pure)."""
    failed = [(s, o) for s, o in results if not o.ok]
    return {
        "sent": len(results),
        "completed": sum(o.ok and o.finish in ("length", "stop") for _, o in results),
        "aborted": sum(o.ok and o.aborted for _, o in results),
        "failed": len(failed),
        "greedy": sum(s.temperature == 0 for s, _ in results),
        "streamed": sum(s.stream for s, _ in results),
        "output_tokens": sum(len(o.output_ids) for _, o in results),
        "failures": [f"{s.rid}: {o.error}" for s, o in failed[:10]],
    }


# ---- the server: idle KV usage, processes and their RSS ----------------------------------------


def idle_loads(url: str, timeout: float = 300.0, settle_s: float = 2.0) -> dict:
    """``/v1/loads`` once nothing runs or waits (and ``settle_s`` later, for aborts in flight)."""
    deadline = time.monotonic() + timeout
    while True:
        load = requests.get(url + "/v1/loads", timeout=30).json()["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            time.sleep(settle_s)
            load = requests.get(url + "/v1/loads", timeout=30).json()["loads"][0]
            if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
                return load
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not idle after {timeout:.0f}s: {load}")
        time.sleep(0.5)


def role_of(cmdline: str) -> str:
    """A server process's role from its command line (pure)."""
    for marker, role in (
        ("sgl_spec.minedraft.draft_server", "draft_server"),
        ("sgl_spec.launch_server", "launcher"),
        ("sglang::scheduler", "scheduler"),
        ("sglang::detokenizer", "detokenizer"),
    ):
        if marker in cmdline:
            return role
    return "other"


def parse_stat(text: str) -> tuple[int, int]:
    """(pid, process group) from a ``/proc/PID/stat`` line (the name may hold spaces)."""
    pid = int(text.split(" ", 1)[0])
    fields = text.rsplit(")", 1)[1].split()
    return pid, int(fields[2])


def group_rss(pgid: int) -> dict[str, int]:
    """RSS bytes per role of every process in the process group ``pgid`` (the server's: the
    launcher starts its own session, and SGLang's and our children stay in it)."""
    page = os.sysconf("SC_PAGE_SIZE")
    rss: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if parse_stat((entry / "stat").read_text())[1] != pgid:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            resident = int((entry / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        role = role_of(cmdline)
        rss[role] = rss.get(role, 0) + resident
    return rss


def snapshot(server: ServerProcess) -> dict:
    load = idle_loads(server.url)
    return {
        "idle_used_tokens": load["num_used_tokens"],
        "max_total_tokens": load["max_total_num_tokens"],
        "rss_bytes": group_rss(server.proc.pid),
    }


def verdict(tallied: dict, start: dict, end: dict, max_rss_growth: float) -> list[str]:
    """Why a soak run fails; empty when it passes (pure)."""
    reasons = []
    if tallied["failed"]:
        reasons.append(f"{tallied['failed']} of {tallied['sent']} requests failed")
    if not tallied["completed"]:
        reasons.append("no request completed")
    if end["idle_used_tokens"] != start["idle_used_tokens"]:
        reasons.append(
            f"idle KV usage {start['idle_used_tokens']} -> {end['idle_used_tokens']} tokens"
        )
    before, after = start["rss_bytes"], end["rss_bytes"]
    for role in sorted(set(before) - {"other"}):
        if role not in after:
            reasons.append(f"{role} process gone")
        elif after[role] >= before[role] * (1 + max_rss_growth):
            reasons.append(f"{role} RSS grew {after[role] / before[role] - 1:.1%}")
    total_before, total_after = sum(before.values()), sum(after.values())
    if total_before and total_after >= total_before * (1 + max_rss_growth):
        reasons.append(f"total RSS grew {total_after / total_before - 1:.1%}")
    return reasons


# ---- one algorithm, and the command line ------------------------------------------------------


def soak_one(algorithm: str, args: argparse.Namespace, extra: list[str], work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    port = pick_port(args.port_base)
    print(f"[{algorithm}] starting the server on port {port} (logs {work})", flush=True)
    with algorithm_env(algorithm):
        server = ServerProcess(server_flags(algorithm, extra), port, work / "server.log")
    try:
        server.wait_ready(args.timeout)
        mix = dict(
            max_prompt_len=args.max_prompt_len,
            max_output_len=args.max_output_len,
            abort_share=args.abort_share,
        )
        warm = traffic(args.seed + 1, prefix=f"warm-{algorithm}", **mix)
        warm_up = [next(warm) for _ in range(args.warmup_requests)]
        with ThreadPoolExecutor(args.concurrency) as pool:  # the shapes traffic will have
            list(pool.map(lambda spec: send(server.url, spec, args.timeout), warm_up))
        start = snapshot(server)
        print(f"[{algorithm}] warm; {args.minutes:g} min of traffic", flush=True)
        began = time.monotonic()
        specs = traffic(args.seed, prefix=f"soak-{algorithm}", **mix)
        results = drive(server.url, specs, args.concurrency, args.minutes * 60, args.timeout)
        seconds = time.monotonic() - began
        end = snapshot(server)
    finally:
        server.stop()
    tallied = tally(results)
    reasons = verdict(tallied, start, end, args.max_rss_growth)
    return {
        "algorithm": algorithm,
        "traffic_seconds": round(seconds, 1),
        **tallied,
        "start": start,
        "end": end,
        "passed": not reasons,
        "reasons": reasons,
    }


def format_run(run: dict) -> str:
    mib = {role: round(b / 2**20) for role, b in run["start"]["rss_bytes"].items()}
    mib_end = {role: round(b / 2**20) for role, b in run["end"]["rss_bytes"].items()}
    status = "PASS" if run["passed"] else "FAIL: " + "; ".join(run["reasons"])
    return (
        f"{run['algorithm']}: sent {run['sent']} completed {run['completed']}"
        f" aborted {run['aborted']} failed {run['failed']} in {run['traffic_seconds']}s;"
        f" idle used tokens {run['start']['idle_used_tokens']} ->"
        f" {run['end']['idle_used_tokens']}; RSS MiB {mib} -> {mib_end}; {status}"
    )


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="soak.py", description=__doc__.split("\n")[0])
    parser.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--abort-share", type=float, default=0.05)
    parser.add_argument("--warmup-requests", type=int, default=32)
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=900.0, help="server start, a request")
    parser.add_argument("--port-base", type=int, default=32000)
    parser.add_argument("--log-dir", default=None)
    args, extra = parser.parse_known_args(argv)
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if args.minutes <= 0 or args.concurrency < 1 or not 0 <= args.abort_share <= 1:
        parser.error("--minutes > 0, --concurrency >= 1 and --abort-share in [0, 1] please")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    logs = Path(args.log_dir or f"/tmp/soak-{os.getpid()}")
    runs = []
    for algorithm in args.algorithms:
        try:
            run = soak_one(algorithm, args, extra, logs / algorithm)
        except Exception as exc:  # a server that does not start or idle: a failed run
            run = {"algorithm": algorithm, "passed": False, "reasons": [repr(exc)[:500]]}
            print(f"{algorithm}: FAIL: {run['reasons'][0]}", flush=True)
        else:
            print(format_run(run), flush=True)
        runs.append(run)
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "host": host_info(),
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "runs": runs,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if all(run["passed"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
