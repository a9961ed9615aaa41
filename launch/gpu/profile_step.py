"""Where a served step's time goes: SGLang's own torch profiler over a few decode steps of one
server (``/start_profile`` with ``num_steps``), and a summary of the chrome trace it writes.

    python launch/gpu/profile_step.py TRACE.json.gz      # print the summary of a saved trace

The summary separates what the GPU did (kernels, copies: their union is the busy time) from
what the host did (torch ops by self time, CUDA runtime calls such as synchronizations, and with
``with_stack`` the Python functions by self time), over the profiled window. A host-bound step
shows as a GPU busy share far under 1 and the host's time in Python or in syncs.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import requests

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 15


def profile_server(
    url: str,
    out_dir: Path,
    send: Callable[[], object],
    num_steps: int,
    with_stack: bool,
    cuda: bool,
    timeout_s: float = 60.0,
) -> Path:
    """Profile the next ``num_steps`` forward steps of the server at ``url`` while ``send()``
    drives it; returns the trace file SGLang wrote into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.trace.json.gz"))
    body = {
        "output_dir": str(out_dir),
        "num_steps": num_steps,
        "activities": ["CPU", "GPU"] if cuda else ["CPU"],
        "with_stack": with_stack,
        "record_shapes": False,
    }
    requests.post(url + "/start_profile", json=body, timeout=60).raise_for_status()
    send()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = sorted(set(out_dir.glob("*.trace.json.gz")) - before)
        if new and _complete(new[-1]):
            return new[-1]
        time.sleep(0.5)
    raise TimeoutError(f"no trace in {out_dir} within {timeout_s:.0f} s")


def _complete(path: Path) -> bool:
    """A gzip file being written is not readable to its end yet."""
    try:
        with gzip.open(path) as fh:
            while fh.read(1 << 20):
                pass
    except (EOFError, OSError):
        return False
    return True


def load_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def self_times(events: list[dict]) -> dict[str, float]:
    """Self time per name (us): an event's duration less its direct children's, nesting taken
    per thread from the timestamps."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[str, float] = defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, self]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                _, name, own = stack.pop()
                out[name] += own
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
        for _, name, own in stack:
            out[name] += own
    return out


def _totals(events: list[dict]) -> tuple[dict[str, float], dict[str, int]]:
    """Total duration (us) and count per event name."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    return total, count


def _top(values: dict[str, float], counts: dict[str, int] | None = None) -> list[list]:
    rows = sorted(values.items(), key=lambda kv: -kv[1])[:TOP]
    return [[name[:120], round(us / 1000, 3), (counts or {}).get(name)] for name, us in rows]


def summarize(path: Path, num_steps: int) -> dict:
    """The trace's window, GPU busy time and the host's top costs (ms over the window)."""
    events = load_events(path)
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        by_cat[e.get("cat", "")].append(e)
    host = by_cat["cpu_op"] + by_cat["user_annotation"] + by_cat["python_function"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in host or events]
    window_us = max(s[1] for s in spans) - min(s[0] for s in spans) if spans else 0.0
    gpu = [e for c in GPU_CATS for e in by_cat[c]]
    busy_us = union_us((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    out = {
        "trace": path.name,
        "events": len(events),
        "steps": num_steps,
        "window_ms": round(window_us / 1000, 2),
        "window_ms_per_step": round(window_us / 1000 / max(1, num_steps), 2),
        "gpu_busy_ms": round(busy_us / 1000, 2),
        "gpu_busy_share": round(busy_us / window_us, 3) if window_us and gpu else None,
        "kernels": len(gpu),
        "top_gpu": _top(*_totals(gpu)),
        "top_runtime": _top(*_totals(by_cat["cuda_runtime"] + by_cat["cuda_driver"])),
        "top_cpu_op_self": _top(self_times(by_cat["cpu_op"])),
        "top_annotation": _top(_totals(by_cat["user_annotation"])[0]),
    }
    if by_cat["python_function"]:
        out["top_python_self"] = _top(self_times(by_cat["python_function"]))
    return out


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1),
                     indent=1))  # fmt: skip
