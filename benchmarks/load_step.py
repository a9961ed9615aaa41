"""Load step: does the speculation controller follow a change of load? ([never-slower] item 3)

    .venv/bin/python benchmarks/load_step.py --algorithm specblock-auto \\
        --phases 1:60,32:60,1:60 --json load_step.json --plot docs/img/load_step_specblock.png

One server of ``--algorithm`` (a row name of ``bench_speculative.py``; unknown flags go to the
server, as there) with ``--enable-metrics``. After a warm-up, clients send greedy requests of
``--input-len`` random prompt tokens and ``--output-len`` new tokens back to back, as many at a
time as the current phase says (``--phases``: ``concurrency:seconds`` pairs). A client above
the phase's concurrency finishes the request it has in flight and waits, so a step down takes
effect when the last extra request ends; the client counts its requests in flight.

Every ``--scrape-every`` seconds the server's Prometheus ``/metrics`` is read: the chosen
setting's histogram ``sglang:spec_chosen_k`` (its sum and count: steps run and the drafts per
request they chose) and ``sglang:spec_plain_steps_total``. Over windows of ``--window`` seconds
that gives the mean chosen k and the decode steps per second.

Per phase the *steady* k is the step-weighted mean over the phase's second half. A transition
starts when the requests in flight reach the new phase's concurrency, and the controller has
*followed* when the windowed mean k first crosses half-way from the previous phase's steady k
to the new one's (a transition whose steady levels differ by less than ``MIN_CHANGE`` has
nothing to follow and is reported so). The JSON keeps every sample; ``--plot`` draws k, steps
per second and requests in flight over time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from _bench_lib import ALGORITHMS, TOKEN_RANGE, algorithm_env, host_info, server_flags
from server_process import ServerProcess, pick_port

K_METRIC = "sglang:spec_chosen_k"
PLAIN_METRIC = "sglang:spec_plain_steps_total"
MIN_CHANGE = 0.5  # steady k levels closer than this: the load step changes nothing to follow


@dataclass(frozen=True)
class Phase:
    concurrency: int
    seconds: float


def parse_phases(text: str) -> list[Phase]:
    """``"1:60,32:60,1:60"`` -> phases; a clear error for anything else."""
    phases = []
    for part in text.split(","):
        try:
            c, s = part.split(":")
            phase = Phase(int(c), float(s))
        except ValueError:
            raise ValueError(f"--phases needs concurrency:seconds pairs, got {part!r}") from None
        if phase.concurrency < 1 or phase.seconds <= 0:
            raise ValueError(f"--phases needs concurrency >= 1 and seconds > 0, got {part!r}")
        phases.append(phase)
    if len(phases) < 2:
        raise ValueError("--phases needs at least two phases (a load step)")
    return phases


def concurrency_at(phases: list[Phase], elapsed: float) -> int:
    """The phase concurrency ``elapsed`` seconds after the start; 0 once every phase ended."""
    for phase in phases:
        if elapsed < phase.seconds:
            return phase.concurrency
        elapsed -= phase.seconds
    return 0


def metric_total(text: str, name: str) -> float:
    """The sum over label sets of the Prometheus series ``name`` in an exposition ``text``
    (0.0 when the server has not created it yet)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sample(text: str) -> dict:
    """What one scrape keeps: the chosen-k histogram's sum and count, the plain steps."""
    return {
        "k_sum": metric_total(text, K_METRIC + "_sum"),
        "k_count": metric_total(text, K_METRIC + "_count"),
        "plain": metric_total(text, PLAIN_METRIC),
    }


def windows(samples: list[dict], window: float) -> list[dict]:
    """Consecutive windows of ``window`` seconds over the scrapes (each ``t``, ``k_sum``,
    ``k_count``, ``inflight``): per window its middle time, the steps run, their mean chosen
    k (None without steps), steps per second and the most requests in flight."""
    out: list[dict] = []
    start = 0
    for end in range(1, len(samples)):
        if samples[end]["t"] - samples[start]["t"] < window and end < len(samples) - 1:
            continue
        a, b = samples[start], samples[end]
        steps = b["k_count"] - a["k_count"]
        span = b["t"] - a["t"]
        out.append(
            {
                "t": (a["t"] + b["t"]) / 2,
                "steps": steps,
                "mean_k": (b["k_sum"] - a["k_sum"]) / steps if steps > 0 else None,
                "steps_per_s": steps / span if span > 0 else 0.0,
                "inflight": max(s["inflight"] for s in samples[start : end + 1]),
            }
        )
        start = end
    return out


def steady_k(wins: list[dict], start: float, end: float) -> float | None:
    """The step-weighted mean k of the windows in the second half of ``[start, end)``."""
    half = [w for w in wins if (start + end) / 2 <= w["t"] < end and w["mean_k"] is not None]
    steps = sum(w["steps"] for w in half)
    return sum(w["mean_k"] * w["steps"] for w in half) / steps if steps else None


def reached(samples: list[dict], after: float, concurrency: int) -> float | None:
    """The first scrape time at or after ``after`` with exactly ``concurrency`` in flight."""
    return next((s["t"] for s in samples if s["t"] >= after and s["inflight"] == concurrency), None)


def follow_time(
    wins: list[dict], since: float, until: float, before: float, after: float
) -> float | None:
    """Seconds from ``since`` to the first window (middle time) in ``[since, until)`` whose
    mean k is past half-way from ``before`` to ``after``; None if none is."""
    half = (before + after) / 2
    for w in wins:
        if since <= w["t"] < until and w["mean_k"] is not None:
            if (w["mean_k"] - half) * (after - before) >= 0:
                return w["t"] - since
    return None


def transitions(phases: list[Phase], samples: list[dict], wins: list[dict]) -> list[dict]:
    """Per phase after the first: the steady k before and after, when the new load was
    reached and how long the controller's choice took to follow it."""
    bounds, t = [], 0.0
    for phase in phases:
        bounds.append((t, t + phase.seconds))
        t += phase.seconds
    out = []
    for i in range(1, len(phases)):
        before = steady_k(wins, *bounds[i - 1])
        after = steady_k(wins, *bounds[i])
        load_at = reached(samples, bounds[i][0], phases[i].concurrency)
        row = {
            "from": phases[i - 1].concurrency,
            "to": phases[i].concurrency,
            "phase_start_s": bounds[i][0],
            "load_reached_s": load_at,
            "steady_k_before": before,
            "steady_k_after": after,
            "follow_s": None,
        }
        if before is None or after is None or load_at is None:
            row["note"] = "no steps or the load was never reached"
        elif abs(after - before) < MIN_CHANGE:
            row["note"] = "steady k the same under both loads: nothing to follow"
        else:
            row["follow_s"] = follow_time(wins, load_at, bounds[i][1], before, after)
        out.append(row)
    return out


def generate(url: str, rng: random.Random, args: argparse.Namespace, max_new_tokens: int):
    """One greedy request of ``--input-len`` random prompt tokens; the response."""
    ids = [rng.randrange(*TOKEN_RANGE) for _ in range(args.input_len)]
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    payload = {"input_ids": ids, "sampling_params": params}
    return requests.post(url + "/generate", json=payload, timeout=args.timeout)


class Driver:
    """Clients sending back-to-back greedy requests at the phases' concurrency, and a scraper
    of ``/metrics``; times are seconds since ``start``."""

    def __init__(self, url: str, phases: list[Phase], args: argparse.Namespace) -> None:
        self.url, self.phases, self.args = url, phases, args
        self.total_s = sum(p.seconds for p in phases)
        self.lock = threading.Lock()
        self.inflight = 0
        self.done = 0
        self.failed: list[str] = []
        self.samples: list[dict] = []
        self.start = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while (now := self.elapsed()) < self.total_s:
            if index >= concurrency_at(self.phases, now):
                time.sleep(0.02)
                continue
            with self.lock:
                self.inflight += 1
            try:
                resp = generate(self.url, rng, self.args, self.args.output_len)
                ok = resp.status_code == 200
                why = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except requests.RequestException as exc:
                ok, why = False, repr(exc)
            with self.lock:
                self.inflight -= 1
                self.done += ok
                if not ok:
                    self.failed.append(why)

    def scrape(self) -> None:
        while (now := self.elapsed()) < self.total_s + self.args.scrape_every:
            try:
                text = requests.get(self.url + "/metrics", timeout=10).text
            except requests.RequestException:
                text = None
            if text is not None:
                with self.lock:
                    inflight = self.inflight
                self.samples.append({"t": round(now, 3), "inflight": inflight, **sample(text)})
            time.sleep(max(0.0, self.args.scrape_every - (self.elapsed() - now)))

    def run(self) -> None:
        most = max(p.concurrency for p in self.phases)
        threads = [threading.Thread(target=self.client, args=(i,)) for i in range(most)]
        threads.append(threading.Thread(target=self.scrape))
        self.start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def warm_up(url: str, args: argparse.Namespace) -> None:
    """Two short requests one after the other: the first phase then measures a warm server.
    The controller meets every other load cold, in the measured phases."""
    rng = random.Random(args.seed - 1)
    for _ in range(2):
        generate(url, rng, args, min(args.output_len, 32)).raise_for_status()


def plot(result: dict, path: Path) -> None:
    """Mean chosen k per window, steps per second and requests in flight over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wins = result["windows"]
    fig, (ax_k, ax_load) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    ax_k.plot([w["t"] for w in wins], [w["mean_k"] for w in wins], "-o", ms=2, color="C3")
    for tr in result["transitions"]:
        if tr["load_reached_s"] is not None:
            ax_k.axvline(tr["load_reached_s"], color="grey", ls="--", lw=1)
        if tr["follow_s"] is not None:
            t = tr["load_reached_s"] + tr["follow_s"]
            ax_k.annotate(
                f"{tr['follow_s']:.1f} s",
                (t, (tr["steady_k_before"] + tr["steady_k_after"]) / 2),
                xytext=(4, 0),
                textcoords="offset points",
                fontsize=8,
            )
    ax_k.set_ylabel(f"mean chosen k ({result['window_s']:g} s windows)")
    ax_k.set_title(f"{result['algorithm']}: load step {result['phases_text']}", fontsize=10)
    ax_k.grid(alpha=0.3)
    ax_load.plot(
        [s["t"] for s in result["samples"]],
        [s["inflight"] for s in result["samples"]],
        color="C0",
        label="requests in flight",
    )
    ax_steps = ax_load.twinx()
    ax_steps.plot(
        [w["t"] for w in wins],
        [w["steps_per_s"] for w in wins],
        color="C2",
        lw=1,
        label="decode steps / s",
    )
    ax_load.set_ylabel("requests in flight", color="C0")
    ax_steps.set_ylabel("decode steps / s", color="C2")
    ax_load.set_xlabel("seconds since the first phase began")
    ax_load.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="load_step.py", description=__doc__.split("\n")[0])
    parser.add_argument("--algorithm", default="specblock-auto", choices=sorted(ALGORITHMS))
    parser.add_argument("--phases", default="1:60,32:60,1:60", help="concurrency:seconds,...")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--scrape-every", type=float, default=0.5, help="seconds")
    parser.add_argument("--window", type=float, default=2.0, help="seconds per k window")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0, help="server start, a request")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/sgl_spec_load_step"))
    args, extra = parser.parse_known_args(argv)
    if not ALGORITHMS[args.algorithm].speculative or ALGORITHMS[args.algorithm].peer:
        parser.error(f"--algorithm {args.algorithm}: no speculation controller to follow")
    if min(args.input_len, args.output_len) < 1 or args.scrape_every <= 0:
        parser.error("--input-len, --output-len and --scrape-every must be positive")
    if args.window < 2 * args.scrape_every:
        parser.error("--window must span at least two scrapes")
    try:
        args.phase_list = parse_phases(args.phases)
    except ValueError as exc:
        parser.error(str(exc))
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    port = pick_port()
    flags = server_flags(args.algorithm, [*extra, "--enable-metrics"])
    with algorithm_env(args.algorithm):
        server = ServerProcess(flags, port, args.log_dir / f"{args.algorithm}.log")
    try:
        server.wait_ready(args.timeout)
        warm_up(server.url, args)
        print(f"[{args.algorithm}] warm; phases {args.phases}", flush=True)
        driver = Driver(server.url, args.phase_list, args)
        driver.run()
    finally:
        server.stop()
    wins = windows(driver.samples, args.window)
    result = {
        "command": " ".join(["benchmarks/load_step.py", *(sys.argv[1:] if argv is None else argv)]),
        "host": host_info(),
        "algorithm": args.algorithm,
        "server_flags": flags,
        "phases_text": args.phases,
        "window_s": args.window,
        "requests_done": driver.done,
        "requests_failed": driver.failed,
        "transitions": transitions(args.phase_list, driver.samples, wins),
        "windows": wins,
        "samples": driver.samples,
    }
    for tr in result["transitions"]:
        print(json.dumps(tr), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 1 if driver.failed else 0


if __name__ == "__main__":
    sys.exit(main())
