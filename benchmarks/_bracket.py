"""``--bracket``: each run of an interleaved round compared with the reference run just
before it and just after it.

A paired ratio (``_bench_lib.paired_ratios``) divides a run by the reference's run of the same
round, which may have run minutes earlier: on a shared host whose speed drifts within a round
(one server's per-round ratios spread 0.15-0.6 at 16-32 requests, RESULTS.md, 2026-12-06) that
leaves the drift in. With ``--bracket`` the reference (the first algorithm) also runs between
every two other runs of a round, and each run is divided by the mean of the reference runs on
either side of it, the nearest measure of the host's speed at that time. It costs about one
reference run per other run.
"""

from __future__ import annotations

import statistics

BRACKET_KEY = "bracket_reference"  # a run's metric of the reference runs before and after it


def bracketed_order(order: list[str], reference: str) -> list[str]:
    """A round's visit order with ``reference`` run first, last and between every two others
    (``order``'s other algorithms keep their order)."""
    sequence = [reference]
    for name in order:
        if name != reference:
            sequence += [name, reference]
    return sequence


def bracketed_ratios(run: dict, metric: str) -> list[float] | None:
    """Per round: ``metric`` of ``run`` / the mean of the reference runs around it. None where
    a round was not bracketed (the reference itself, a run without ``--bracket``)."""
    rounds = run.get("rounds") or [run]
    ratios = []
    for one in rounds:
        around, value = one.get(BRACKET_KEY), one.get(metric)
        if not around or value is None or not all(around):
            return None
        ratios.append(value / statistics.fmean(around))
    return ratios


def add_bracketed_ratios(runs: list[dict], metric: str = "output_throughput") -> None:
    """``ratios["<metric>_bracketed"]`` (median over rounds) and ``..._bracketed_range``
    ([min, max] over rounds, with two rounds or more) for every bracketed run."""
    for run in runs:
        if "error" in run or "ratios" not in run:
            continue
        per_round = bracketed_ratios(run, metric)
        if per_round is None:
            continue
        run["ratios"][f"{metric}_bracketed"] = statistics.median(per_round)
        if len(per_round) > 1:
            run["ratios"][f"{metric}_bracketed_range"] = [min(per_round), max(per_round)]


class Brackets:
    """Within one round: hands each run the reference's ``metric`` before and after it."""

    def __init__(self, reference: str, metric: str = "output_throughput") -> None:
        self.reference = reference
        self.metric = metric
        self._before: float | None = None  # the reference's last run of this round
        self._waiting: dict | None = None  # a run still waiting for the reference after it
        self.count = 0  # reference runs so far in this round

    def ran(self, name: str, run: dict) -> None:
        """``name``'s ``run`` just finished (in ``bracketed_order``)."""
        if name != self.reference:
            self._waiting = run if "error" not in run else None
            return
        self.count += 1
        value = run.get(self.metric) if "error" not in run else None
        if self._waiting is not None and self._before is not None and value is not None:
            self._waiting[BRACKET_KEY] = [self._before, value]
        self._waiting, self._before = None, value
