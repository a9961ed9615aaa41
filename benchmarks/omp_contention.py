"""How a background torch thread slows a 2-thread torch loop on a CPU host: the measurement
behind the SPECBLOCK adaptation trainer's CPU setup (``adapt/update.py``: one intra-op thread,
raised niceness).

The main thread runs a small MLP-like loop with 2 intra-op threads (as a serving scheduler
does); a background thread runs forward + backward steps configured by ``--background``:

- ``none``: no background thread;
- ``THREADS[,nice=N][,sleep=S]``: that many intra-op threads in the background thread, its
  niceness raised by N, S seconds of sleep between its steps.

Prints the main loop's microseconds per iteration, ``--repeats`` times.

    python benchmarks/omp_contention.py --background none --background 2 --background 1,nice=10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import torch


def parse_background(text: str) -> dict | None:
    if text == "none":
        return None
    threads, *opts = text.split(",")
    spec = {"threads": int(threads), "nice": 0, "sleep": 0.0}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in ("nice", "sleep"):
            raise ValueError(f"unknown background option {opt!r}")
        spec[key] = float(value) if key == "sleep" else int(value)
    if spec["threads"] < 1:
        raise ValueError("background threads must be >= 1")
    return spec


def background(spec: dict, stop: threading.Event) -> None:
    if spec["nice"]:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + spec["nice"])
    torch.set_num_threads(spec["threads"])
    a = torch.randn(256, 512, requires_grad=True)
    b = torch.randn(512, 512)
    while not stop.is_set():
        (a @ b).tanh().sum().backward()
        if spec["sleep"]:
            time.sleep(spec["sleep"])


def main_loop(iterations: int) -> float:
    x, w1, w2 = torch.randn(16, 256), torch.randn(256, 1024), torch.randn(1024, 256)
    tic = time.perf_counter()
    for _ in range(iterations):
        h = (x @ w1).relu() @ w2
        torch.nn.functional.layer_norm(h, (256,)).softmax(-1)
    return (time.perf_counter() - tic) / iterations * 1e6


def measure(spec: dict | None, iterations: int, repeats: int) -> list[float]:
    main_loop(200)  # warm up the main thread's team
    stop = threading.Event()
    thread = None
    if spec is not None:
        thread = threading.Thread(target=background, args=(spec, stop), daemon=True)
        thread.start()
        time.sleep(0.5)
    try:
        return [main_loop(iterations) for _ in range(repeats)]
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--background", action="append", default=None, help="see the docstring")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    configs = args.background or ["none"]
    for text in configs:
        parse_background(text)  # fail before running anything
    if not args.one:  # each configuration in a fresh process: OpenMP teams outlive their use
        for text in configs:
            cmd = [sys.executable, __file__, "--one", "--background", text]
            cmd += ["--iterations", str(args.iterations), "--repeats", str(args.repeats)]
            subprocess.run(cmd, check=True)
        return 0
    torch.set_num_threads(2)
    times = measure(parse_background(configs[0]), args.iterations, args.repeats)
    line = " / ".join(f"{t:.0f}" for t in times)
    print(f"background {configs[0]:>16}: main loop {line} us per iteration", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
