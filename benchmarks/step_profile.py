"""Where a served step's time goes, per algorithm: py-spy samples of the scheduler process.

    .venv/bin/python benchmarks/step_profile.py --algorithms none,standalone,specblock,mtp_lora \
        [--seconds 20] [--json OUT] [-- server flags...]

For each algorithm in turn: one server with the flags ``bench_speculative.py`` gives it,
``--concurrency`` clients (1 by default) each sending greedy 128-token requests one at a time,
and ``py-spy record`` on the scheduler process (raw stacks, ``--rate`` a second, active samples
only) for ``--seconds``. Each sample goes to one bucket by the frames on its stack:

- ``target fwd``: inside the model's own forward (``*ForCausalLM.forward``), not drafting;
- ``draft fwd``: a draft model's or drafter's forward (a drafting frame above it);
- ``draft other``: drafting code outside any forward (tree building, KV gathers, packing);
- ``around``: everything else the scheduler runs: batch set-up, attention metadata, verify
  bookkeeping, sampling, result processing, request handling.

Drafting frames are the algorithms' drafting functions (``DRAFT_FRAMES``). A sample the
profiler took while the interpreter was between frames is counted in ``around``. py-spy slows
the process it samples a little; the shares, not the absolute rate, are the result.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_lib
from server_process import ServerProcess, pick_port

MODEL_FORWARD = re.compile(r"ForCausalLM\.forward |SpecBlockDrafter\.forward ")
# frames of each algorithm's drafting (SGLang's draft workers for STANDALONE and NGRAM, ours;
# SPECBLOCK's drafter extend after a verify and its catch-up run in ``DrafterFollowing``)
DRAFT_FRAMES = re.compile(
    r"SpecBlockWorker\._draft |DrafterFollowing\._follow |DrafterFollowing\._catch_up |"
    r"DraftWorker\.draft|\.draft_forward |_draft_extend|\.forward_draft_extend|"
    r"NGRAMWorker\._prepare_draft|NgramWorker\._prepare_draft|MtpWorker\._draft"
)
BUCKETS = ("target fwd", "draft fwd", "draft other", "around")
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def bucket(stack: str) -> str:
    drafting = DRAFT_FRAMES.search(stack) is not None
    forward = MODEL_FORWARD.search(stack) is not None
    if drafting:
        return "draft fwd" if forward else "draft other"
    return "target fwd" if forward else "around"


def summarise(raw: str) -> dict:
    """Bucket shares and the heaviest leaf frames of ``around`` from py-spy's raw output."""
    counts: Counter[str] = Counter()
    around: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        which = bucket(stack)
        counts[which] += int(n)
        if which == "around":
            around[stack.rsplit(";", 1)[-1]] += int(n)
    total = sum(counts.values())
    shares = {name: counts[name] / total if total else 0.0 for name in BUCKETS}
    top = [(frame, n / total) for frame, n in around.most_common(5)] if total else []
    return {"samples": total, "shares": shares, "around_top": top}


def _request(url: str) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True},
    }
    requests.post(url + "/generate", json=body, timeout=300).raise_for_status()


def _drive(url: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            _request(url)
        except requests.RequestException:
            if not stop.is_set():  # the server went away while sampling
                raise


def _scheduler_pid(launcher_pid: int) -> int:
    """The launcher's child that runs the scheduler (SGLang names it ``sglang::scheduler``)."""
    out = subprocess.run(
        ["pgrep", "-f", "-g", str(launcher_pid), "sglang::scheduler"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if not out:
        raise RuntimeError(f"no scheduler process under launcher {launcher_pid}")
    return int(out[0])


def profile(
    algorithm: str, extra: list[str], seconds: float, work: Path, concurrency: int = 1
) -> dict:
    flags = _bench_lib.server_flags(algorithm, extra)
    with _bench_lib.algorithm_env(algorithm):
        server = ServerProcess(flags, pick_port(), work / f"{algorithm}.log")
    stop = threading.Event()
    try:
        server.wait_ready(600)
        _request(server.url)  # one request before sampling
        for _ in range(concurrency):
            threading.Thread(target=_drive, args=(server.url, stop), daemon=True).start()
        time.sleep(2)
        raw = work / f"{algorithm}.raw"
        py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
        subprocess.run(
            [py_spy, "record", "--pid", str(_scheduler_pid(server.proc.pid)), "--format", "raw",
             "--rate", "200", "--duration", str(int(seconds)), "--nonblocking", "-o", str(raw)],
            check=True, capture_output=True,
        )  # fmt: skip
        return summarise(raw.read_text())
    finally:
        stop.set()
        server.stop()


def format_table(results: dict[str, dict]) -> str:
    head = "| algorithm | samples | " + " | ".join(BUCKETS) + " | heaviest `around` frames |"
    lines = [head, "|" + " --- |" * (len(BUCKETS) + 3)]
    for name, r in results.items():
        shares = " | ".join(f"{100 * r['shares'][b]:.1f}%" for b in BUCKETS)
        top = "; ".join(
            f"{frame.split(' (')[0]} {100 * s:.1f}%" for frame, s in r["around_top"][:3]
        )
        lines.append(f"| {name} | {r['samples']} | {shares} | {top} |")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", default="none,standalone,specblock,mtp_lora")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None, help="server logs and raw stacks (default: tmp)")
    p.add_argument("--variant", action="append", default=[], help="as bench_speculative.py")
    p.add_argument("--from-raw", action="store_true", help="re-read --log-dir's stacks, no run")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    for text in args.variant:
        _bench_lib.register_variant(text)
    names = _bench_lib.parse_algorithms(args.algorithms)
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="step_profile_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.from_raw:
        results = {name: summarise((work / f"{name}.raw").read_text()) for name in names}
    else:
        results = {
            name: profile(name, extra, args.seconds, work, args.concurrency) for name in names
        }
    out = {"command": " ".join(sys.argv), "host": _bench_lib.host_info(), "results": results}
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
