"""The MTP_LORA controller's k over time, from the worker's per-step trace.

With ``SGLSPEC_MTP_TRACE=FILE`` in its environment the MTP_LORA worker
(``sgl_spec/mtp/worker.py``, ``TRACE_ENV``) appends one line per decode step,
``start_time k batch_size step_ms decision``, where ``start_time`` is ``time.perf_counter()``.
On Linux that is ``CLOCK_MONOTONIC``, one clock for every process of the host, so the
benchmark's own ``perf_counter()`` places the steps on its time line. Runs of steps with the
same k and batch size become one segment, which keeps a sweep's few thousand steps small in
the result JSON.
"""

from __future__ import annotations

from pathlib import Path

TRACE_ENV = "SGLSPEC_MTP_TRACE"
TRACE_FILE = "mtp_trace.txt"
# A pause longer than this (the server idle while the others are driven) ends a segment.
MAX_GAP_S = 1.0


def is_mtp_lora(flags: tuple[str, ...] | list[str]) -> bool:
    """Do these server flags serve MTP_LORA (the only worker that writes the trace)?"""
    flags = list(flags)
    for i, flag in enumerate(flags):
        if flag == "--speculative-algorithm" and i + 1 < len(flags):
            return flags[i + 1] == "MTP_LORA"
        if flag == "--speculative-algorithm=MTP_LORA":
            return True
    return False


def parse_trace(text: str) -> list[tuple[float, float, int, int]]:
    """``(start_time, step_s, k, batch_size)`` per step; lines that do not parse (a line cut
    by a server stopped mid-write) are skipped."""
    steps = []
    for line in text.splitlines():
        words = line.split()
        try:
            steps.append((float(words[0]), float(words[3]) / 1000, int(words[1]), int(words[2])))
        except (IndexError, ValueError):
            continue
    return steps


def segments(steps: list[tuple[float, float, int, int]], t0: float) -> list[dict]:
    """Consecutive steps of one k and batch size, times in seconds since ``t0``."""
    out: list[dict] = []
    end = 0.0
    for start, seconds, k, batch_size in sorted(steps):
        last = out[-1] if out else None
        if (
            last is None
            or (last["k"], last["batch_size"]) != (k, batch_size)
            or start - end > MAX_GAP_S
        ):
            last = {"t_start_s": round(start - t0, 3), "t_end_s": None, "k": k}
            last.update(batch_size=batch_size, num_steps=0)
            out.append(last)
        end = start + seconds
        last["num_steps"] += 1
        last["t_end_s"] = round(end - t0, 3)
    return out


def read_segments(paths: list[Path], t0: float) -> list[dict]:
    """The segments of every trace file in ``paths`` that exists, merged in time order; steps
    before ``t0`` (an earlier benchmark's, in a reused log directory) are left out."""
    steps = []
    for path in paths:
        if path.exists():
            steps += [s for s in parse_trace(path.read_text(errors="replace")) if s[0] >= t0]
    return segments(steps, t0)
