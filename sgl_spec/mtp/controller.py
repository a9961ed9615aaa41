"""Choose how many drafts to speculate per step from measured γ-tolerance and live acceptance.

Seed paper §3.1: with τ(γ) = T(1)/T(γ) the latency ratio of a target forward that carries γ
tokens per request, and δ = T_D/T(1) the drafter's per-draft cost, a step that proposes γ
drafts has speedup (equation 1)

    S = λ·τ(γ+1) / (1 + γ·δ·τ(γ+1)),

where λ, the *acceptance length*, is the expected number of tokens a step commits: accepted
drafts plus the bonus token. Speculation pays only while S > 1, and on large batches τ falls
fast with γ (§4.1), so the best number of drafts k depends on batch size, context length and
how well drafts are currently accepted. This module is pure (no SGLang): ``GammaTable`` holds τ
measured by ``benchmarks/gamma_tolerance.py``; ``SpeculationController`` keeps per-position
acceptance estimates and returns the k with the highest predicted S, or 0 (speculation off).

Online calibration (beyond the paper): an offline τ table times a bare forward, while a served
step also pays the method's own work (masks, tree attention, acceptance), so the table can be
far too optimistic for a given serving stack. With ``calibrate_steps > 0`` the controller also
keeps ``StepTimes``, the lower quartile of recent served step times per batch-size bucket and
k, reported by the worker (not a mean or a median: the first steps of a fresh server and host
contention make steps several times slower, never faster, and T(0) and T(k) are measured at
different times); once both T(k) and T(0) are measured in a bucket,
S = λ(k)·T(0)/T(k) replaces equation 1 there (the measured T(k) already includes drafting, so
δ is folded in). Without a table an unmeasured k is bounded by the step times of the smaller
k measured so far (more tokens per request never cost less): it is probed only if that
optimistic bound could beat k = 0, so a host where one draft already costs too much pays for
measuring k = 1 only. τ(k) measured at a smaller batch size bounds it too (τ does not rise
with batch size), so a new batch-size bucket -- a serving run passes through many while its
batch fills and drains -- probes only the k that a smaller batch left worth trying. Periodic probes keep every estimate fresh: a probe of k = 0 refreshes
T(0) while speculating, a probe of k > 0 refreshes its T(k) and α while speculation is off --
at intervals that double, up to ``MAX_EXPLORE_BACKOFF`` times, while probes keep confirming it.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral
from pathlib import Path
from typing import Protocol


def predicted_speedup(lam: float, tau: float, gamma: int, delta: float) -> float:
    """Equation 1: ``lam * tau / (1 + gamma * delta * tau)``.

    ``gamma`` is the number of drafts, ``tau`` is τ at the verification length of that step
    (γ+1 for a chain; whatever the method feeds per request otherwise), ``lam`` the
    acceptance length (>= 1, includes the bonus token) and ``delta`` = T_D / T(1).
    """
    if lam < 1 or tau <= 0 or gamma < 0 or delta < 0:
        raise ValueError(
            f"need lam >= 1, tau > 0, gamma >= 0, delta >= 0; got {lam=}, {tau=}, {gamma=}, {delta=}"
        )
    return lam * tau / (1.0 + gamma * delta * tau)


# --- measured τ -----------------------------------------------------------------------------


def _bracket(axis: Sequence[int], x: float) -> tuple[int, int, float]:
    """Indices around ``x`` on a sorted axis and the weight of the upper one, in log space;
    ``x`` outside the axis is clamped to its ends."""
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        last = len(axis) - 1
        return last, last, 0.0
    hi = bisect.bisect_right(axis, x)
    lo = hi - 1
    weight = (math.log(x) - math.log(axis[lo])) / (math.log(axis[hi]) - math.log(axis[lo]))
    return lo, hi, weight


@dataclass(frozen=True)
class GammaTable:
    """τ on a full grid of batch sizes × context lengths × γ (tokens per request).

    ``tau`` interpolates multilinearly in (log bs, log ctx, log γ) and clamps outside the grid.
    Beyond the largest measured γ that clamp is optimistic (τ keeps falling), which is why the
    controller refuses a cost model whose largest step exceeds ``max_gamma``.
    """

    batch_sizes: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    gammas: tuple[int, ...]
    values: Mapping[tuple[int, int, int], float] = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "ctx_lens", "gammas"):
            axis = getattr(self, name)
            if not axis or list(axis) != sorted(set(axis)) or axis[0] < 1:
                raise ValueError(f"GammaTable.{name} must be sorted, distinct and >= 1: {axis}")
        missing = [
            (b, c, g)
            for b in self.batch_sizes
            for c in self.ctx_lens
            for g in self.gammas
            if (b, c, g) not in self.values
        ]
        if missing:
            raise ValueError(
                f"GammaTable needs a full grid; missing (bs, ctx, gamma) {missing[:5]}"
            )
        bad = {k: v for k, v in self.values.items() if not (v > 0 and math.isfinite(v))}
        if bad:
            raise ValueError(f"GammaTable values must be positive and finite: {bad}")

    @classmethod
    def from_points(cls, points: Sequence[Mapping]) -> GammaTable:
        """From ``{"batch_size", "ctx_len", "gamma", "tau"}`` records (the benchmark's points)."""
        values = {
            (int(p["batch_size"]), int(p["ctx_len"]), int(p["gamma"])): float(p["tau"])
            for p in points
        }
        return cls(
            batch_sizes=tuple(sorted({k[0] for k in values})),
            ctx_lens=tuple(sorted({k[1] for k in values})),
            gammas=tuple(sorted({k[2] for k in values})),
            values=values,
        )

    @classmethod
    def load(cls, path: str | Path) -> GammaTable:
        """The JSON written by ``benchmarks/gamma_tolerance.py``."""
        data = json.loads(Path(path).read_text())
        if "points" not in data:
            raise ValueError(f"{path}: no 'points' (not a gamma_tolerance.py result)")
        return cls.from_points(data["points"])

    @property
    def max_gamma(self) -> int:
        return self.gammas[-1]

    def tau(self, batch_size: float, ctx_len: float, gamma: float) -> float:
        brackets = [
            _bracket(self.batch_sizes, batch_size),
            _bracket(self.ctx_lens, ctx_len),
            _bracket(self.gammas, gamma),
        ]
        axes = (self.batch_sizes, self.ctx_lens, self.gammas)
        total = 0.0
        for corner in range(8):
            weight, key = 1.0, []
            for axis_i, (lo, hi, w) in enumerate(brackets):
                upper = (corner >> axis_i) & 1
                weight *= w if upper else 1.0 - w
                key.append(axes[axis_i][hi if upper else lo])
            if weight:
                total += weight * self.values[tuple(key)]
        return total


# --- cost of a step with k drafts -----------------------------------------------------------


class StepCost(Protocol):
    """How a method with k drafts uses the target: tokens per request in the verify forward
    (the γ at which τ is read) and δ, the cost of one draft relative to T(1)."""

    delta: float

    def tokens_per_step(self, k: int) -> int: ...


@dataclass(frozen=True)
class MTPGatedLoRACost:
    """MTP with gated LoRA (§4.3): k+1 anchors each followed by k masks, one forward, so
    (k+1)² tokens per request and no separate drafter (δ = 0)."""

    delta: float = 0.0

    def tokens_per_step(self, k: int) -> int:
        return (k + 1) ** 2


@dataclass(frozen=True)
class DrafterCost:
    """A drafter-based chain (STANDALONE, EAGLE with topk 1): k drafts, verify k+1 tokens, and
    each draft costs ``delta`` = T_D / T(1)."""

    delta: float

    def __post_init__(self) -> None:
        if not (self.delta >= 0 and math.isfinite(self.delta)):
            raise ValueError(f"DrafterCost.delta must be >= 0, got {self.delta}")

    def tokens_per_step(self, k: int) -> int:
        return k + 1


# --- measured step times --------------------------------------------------------------------


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share timing statistics per power of two (rounded in log space)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return round(math.log2(batch_size))


@dataclass
class StepTimes:
    """Lower quartile of the last ``window`` served step seconds per (batch-size bucket, k)
    (the smallest of 3, the 3rd smallest of 9); a value counts as measured once it has
    ``min_samples`` observations. Noise only ever adds time: the first steps after start-up
    (lazy initialisation) and bursts of host contention make steps several times slower. T(0)
    and T(k) are sampled at different times, so a median still follows a burst that lasts
    half a window -- measured here: a burst doubled the recent plain steps, T(0)/T(1) read
    0.85 instead of 0.52, and k = 1 ran for 144 steps at 0.8x. A low quantile keeps the cost
    of the step itself."""

    window: int = 9
    min_samples: int = 3
    _samples: dict[tuple[int, int], deque] = field(default_factory=dict, repr=False)
    _counts: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_samples <= self.window:
            raise ValueError(
                f"need 1 <= min_samples <= window, got {self.min_samples}, {self.window}"
            )

    def update(self, batch_size: int, k: int, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return  # a clock hiccup says nothing about cost
        key = (batch_bucket(batch_size), k)
        self._samples.setdefault(key, deque(maxlen=self.window)).append(seconds)
        self._counts[key] = self._counts.get(key, 0) + 1

    def get(self, batch_size: int, k: int) -> float | None:
        return self._get_bucket(batch_bucket(batch_size), k)

    def count(self, batch_size: int, k: int) -> int:
        return self._counts.get((batch_bucket(batch_size), k), 0)

    def tau_from_smaller_batch(self, batch_size: int, k: int) -> float | None:
        """T(0)/T(k) of the nearest smaller batch-size bucket where both are measured.

        τ does not rise with batch size (a larger batch leaves less idle compute for the extra
        tokens, seed paper §4.1), so this bounds τ(k) of ``batch_size``'s bucket from above
        before that bucket has measured k itself."""
        bucket = batch_bucket(batch_size)
        below = sorted({b for b, j in self._samples if j == k and b < bucket}, reverse=True)
        for b in below:
            t0, tk = self._get_bucket(b, 0), self._get_bucket(b, k)
            if t0 is not None and tk is not None:
                return t0 / tk
        return None

    def _get_bucket(self, bucket: int, k: int) -> float | None:
        if self._counts.get((bucket, k), 0) < self.min_samples:
            return None
        samples = sorted(self._samples[(bucket, k)])
        return samples[(len(samples) - 1) // 4]


# --- the controller -------------------------------------------------------------------------

# While probes keep confirming that speculation does not pay, the wait between them doubles up
# to this multiple of ``explore_every``; a step that speculates on merit resets it.
MAX_EXPLORE_BACKOFF = 8


@dataclass(frozen=True)
class ControllerConfig:
    """``alpha_prior``: α_j, the probability that draft j is accepted given drafts 1..j-1 were,
    before any observation (one value for every position, or one per position 1..k_max).
    ``ewma_weight``: weight of a new observation in the running α_j. ``margin``: speculate
    only when predicted S > 1 + margin. ``explore_every``: after that many consecutive steps
    at k = 0, try the best k > 0 for ``probe_steps`` steps so α can recover (0 never explores).
    ``calibrate_steps`` > 0 turns online calibration on: step times count as measured after
    that many observations, k = 0 is measured first in every batch-size bucket, k without any
    τ estimate (no table) are measured before use, and while speculating k = 0 is probed for one
    step every ``explore_every`` steps. ``time_window``: step times kept per (bucket, k) for
    their lower quartile.
    ``switch_on_margin``: extra margin to turn speculation on while it is off -- the first
    step after k = 0 has no drafts to verify (it pays T(k) for one token), so a marginal
    predicted gain would be eaten by switching back and forth.
    ``warmup_steps``: with calibration, the first steps a server runs are plain (k = 0) and
    their times are not recorded: lazy initialisation makes them several times slower than the
    rest, and T(0) is the reference every τ is measured against. T(0) then counts as measured
    only after a full ``time_window`` of plain steps (they cost nothing extra)."""

    k_max: int = 4
    alpha_prior: float | tuple[float, ...] = 0.7
    ewma_weight: float = 0.05
    margin: float = 0.02
    explore_every: int = 64
    probe_steps: int = 1
    calibrate_steps: int = 0
    time_window: int = 9
    switch_on_margin: float = 0.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        prior = self.alpha_prior
        if isinstance(prior, (tuple, list)):
            if len(prior) != self.k_max:
                raise ValueError(f"alpha_prior has {len(prior)} values, k_max is {self.k_max}")
            values = prior
        else:
            values = (prior,)
        if not all(0.0 <= a <= 1.0 for a in values):
            raise ValueError(f"alpha_prior values must lie in [0, 1], got {prior}")
        if not 0.0 < self.ewma_weight <= 1.0:
            raise ValueError(f"ewma_weight must lie in (0, 1], got {self.ewma_weight}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if self.switch_on_margin < 0:
            raise ValueError(f"switch_on_margin must be >= 0, got {self.switch_on_margin}")
        if self.explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {self.explore_every}")
        if self.probe_steps < 1:
            raise ValueError(f"probe_steps must be >= 1, got {self.probe_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.calibrate_steps < 0:
            raise ValueError(f"calibrate_steps must be >= 0, got {self.calibrate_steps}")
        if self.time_window < max(self.calibrate_steps, 1):
            raise ValueError(
                f"time_window must be >= max(calibrate_steps, 1), got {self.time_window}"
            )

    def prior(self) -> list[float]:
        if isinstance(self.alpha_prior, (tuple, list)):
            return [float(a) for a in self.alpha_prior]
        return [float(self.alpha_prior)] * self.k_max


@dataclass(frozen=True)
class Decision:
    """What ``SpeculationController`` chose, with the numbers behind it for logging.

    ``gamma`` is the tokens per request of the verify forward, ``tau`` = τ(gamma), ``lam`` the
    predicted acceptance length; ``explore`` marks a k tried only to refresh an estimate.
    ``source`` says where τ came from: "measured" (served step times, τ = T(0)/T(k)),
    "table" (the γ table), "bound" (no table, T(k) not measured yet: the smallest τ(j), j <= k, measured in this
    batch-size bucket or the nearest smaller one -- an upper bound, since T(k) >= T(j)), "prior" (nothing known yet; τ = 1) or "calibrate"
    (k = 0 run to measure T(0))."""

    k: int
    predicted_speedup: float
    gamma: int
    tau: float
    lam: float
    explore: bool = False
    source: str = "table"


class SpeculationController:
    """argmax_k S(k) = λ(k)·τ(γ(k)) / (1 + k·δ·τ(γ(k))) over k in [0, k_max], with
    λ(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j from running per-position acceptance estimates.

    α_j is estimated conditionally (accepted among the requests that reached draft j) rather
    than as one EWMA of whole accept lengths, so observations made at one k stay valid for
    predicting another. A position beyond the k in use is never observed and keeps its last
    estimate. τ comes from the table, or, with online calibration, from measured step times.

    ``predict`` and ``best`` are pure; ``decide``/``choose_k`` add calibration and probes,
    ``observe`` updates α and ``observe_step`` the step times -- the only places that change
    state. ``table`` may be None only with online calibration on.
    """

    def __init__(
        self, table: GammaTable | None, cost: StepCost, config: ControllerConfig | None = None
    ) -> None:
        self.table = table
        self.cost = cost
        self.config = config or ControllerConfig()
        if table is None and not self.config.calibrate_steps:
            raise ValueError("a controller without a γ table needs calibrate_steps > 0")
        largest = cost.tokens_per_step(self.config.k_max)
        if table is not None and largest > table.max_gamma:
            raise ValueError(
                f"k_max={self.config.k_max} needs τ at γ={largest} tokens per request, but the "
                f"table stops at γ={table.max_gamma}; measure larger --gammas or lower k_max"
            )
        self.alphas = self.config.prior()
        self.times = StepTimes(
            window=self.config.time_window, min_samples=max(self.config.calibrate_steps, 1)
        )
        self.num_steps_off = 0  # consecutive steps at k = 0
        self.num_steps_seen = 0  # steps reported to observe_step, warm-up included
        self.num_steps_on = 0  # consecutive steps at k > 0
        self._backoff = 1  # explore_every multiplier while speculation stays off
        self._probe: tuple[int, int] | None = None  # (k, steps left)

    @property
    def calibrating(self) -> bool:
        return self.config.calibrate_steps > 0

    def acceptance_length(self, k: int) -> float:
        """λ(k): 1 (the bonus token) + expected number of accepted drafts."""
        lam, survive = 1.0, 1.0
        for alpha in self.alphas[:k]:
            survive *= alpha
            lam += survive
        return lam

    def predict(self, k: int, batch_size: int, ctx_len: int) -> Decision:
        """Predicted S for exactly ``k`` drafts (k = 0: no speculation, S = 1 by definition)."""
        gamma = self.cost.tokens_per_step(k)
        lam = self.acceptance_length(k)
        t0 = self.times.get(batch_size, 0) if self.calibrating else None
        tk = self.times.get(batch_size, k) if self.calibrating else None
        if t0 is not None and tk is not None:
            tau = t0 / tk
            return Decision(k, lam * tau if k else 1.0, gamma, tau, lam, source="measured")
        if self.table is None:
            if t0 is None or k == 0:
                return Decision(k, lam if k else 1.0, gamma, 1.0, lam, source="prior")
            # T(k) >= T(j) for every j < k, so τ(k) <= τ(j) for every j <= k known here or,
            # not yet measured here, at a smaller batch size; the tightest bound counts.
            tau = 1.0
            for j in range(1, k + 1):
                tj = self.times.get(batch_size, j) if j < k else None
                bound = (
                    t0 / tj if tj is not None else self.times.tau_from_smaller_batch(batch_size, j)
                )
                if bound is not None:
                    tau = min(tau, bound)
            return Decision(k, lam * tau, gamma, tau, lam, source="bound")
        tau = self.table.tau(batch_size, ctx_len, gamma)
        if k == 0:
            return Decision(0, 1.0, gamma, tau, lam)
        speedup = predicted_speedup(lam, tau, k, self.cost.delta)
        return Decision(k, speedup, gamma, tau, lam)

    def best(
        self, batch_size: int, ctx_len: int, min_k: int = 0, extra_margin: float = 0.0
    ) -> Decision:
        """The k >= ``min_k`` of highest predicted S; with ``min_k`` 0, k = 0 unless some
        k beats 1 + margin + ``extra_margin``."""
        candidates = [
            self.predict(k, batch_size, ctx_len)
            for k in range(max(min_k, 1), self.config.k_max + 1)
        ]
        top = max(candidates, key=lambda d: d.predicted_speedup)
        if min_k == 0 and top.predicted_speedup <= 1.0 + self.config.margin + extra_margin:
            return self.predict(0, batch_size, ctx_len)
        return top

    def decide(self, batch_size: int, ctx_len: int) -> Decision:
        if self._probe is not None:
            k, left = self._probe
            self._probe = (k, left - 1) if left > 1 else None
            return replace(self.predict(k, batch_size, ctx_len), explore=True)
        if self.calibrating:
            if self.num_steps_seen < self.config.warmup_steps:
                return replace(self.predict(0, batch_size, ctx_len), source="calibrate")
            needed = self._calibration_step(batch_size, ctx_len)
            if needed is not None:
                return needed
        extra = 0.0 if self.num_steps_on else self.config.switch_on_margin
        decision = self.best(batch_size, ctx_len, extra_margin=extra)
        every = self.config.explore_every
        if decision.k > 0:
            self.num_steps_off = 0
            self.num_steps_on += 1
            self._backoff = 1
            if self.calibrating and every and self.num_steps_on % (every + 1) == 0:
                # refresh T(0) with one plain step; speculation stays on
                return replace(self.predict(0, batch_size, ctx_len), explore=True)
            return decision
        self.num_steps_on = 0
        if every and self.num_steps_off >= every * self._backoff:
            self.num_steps_off = 0
            # Each probe that leaves speculation off doubles the wait for the next one.
            self._backoff = min(2 * self._backoff, MAX_EXPLORE_BACKOFF)
            explore = self.best(batch_size, ctx_len, min_k=1)
            return self._start_probe(explore)
        self.num_steps_off += 1
        return decision

    def _calibration_step(self, batch_size: int, ctx_len: int) -> Decision | None:
        """k = 0 until T(0) is measured in this bucket; then, without a table, each k > 0 in
        increasing order (a probe long enough to be measured) unless the bound from the smaller
        k already rules it out."""
        if self.times.get(batch_size, 0) is None or (
            self.config.warmup_steps and self.times.count(batch_size, 0) < self.times.window
        ):
            return replace(self.predict(0, batch_size, ctx_len), source="calibrate")
        if self.table is None:
            for k in range(1, self.config.k_max + 1):
                if self.times.get(batch_size, k) is not None:
                    continue
                bound = self.predict(k, batch_size, ctx_len)
                if bound.predicted_speedup <= 1.0 + self.config.margin:
                    continue  # cannot pay even if it cost no more than the last measured k
                steps = self.times.min_samples - self.times.count(batch_size, k)
                return self._start_probe(bound, steps)
        return None

    def _start_probe(self, decision: Decision, steps: int | None = None) -> Decision:
        steps = max(steps or 0, self.config.probe_steps)
        if steps > 1:
            self._probe = (decision.k, steps - 1)
        return replace(decision, explore=True)

    def choose_k(self, batch_size: int, ctx_len: int) -> int:
        return self.decide(batch_size, ctx_len).k

    def observe_step(self, k: int, batch_size: int, seconds: float) -> None:
        """A served step with ``k`` drafts for ``batch_size`` requests took ``seconds``."""
        self.num_steps_seen += 1
        if self.calibrating and self.num_steps_seen > self.config.warmup_steps:
            self.times.update(batch_size, k, seconds)

    def observe(self, k_used: int, num_accepted_drafts: int | Sequence[int]) -> None:
        """Update α from one request's accepted-draft count, or one count per request of a
        batch. Draft j was *reached* when drafts 1..j-1 were accepted; α_j moves toward the
        fraction of reaching requests that accepted it, one EWMA step per call."""
        if isinstance(num_accepted_drafts, Integral):
            counts = [int(num_accepted_drafts)]
        else:
            counts = [int(a) for a in num_accepted_drafts]
        if k_used < 0 or k_used > self.config.k_max:
            raise ValueError(f"k_used must lie in [0, {self.config.k_max}], got {k_used}")
        if any(not 0 <= a <= k_used for a in counts):
            raise ValueError(f"num_accepted_drafts must lie in [0, {k_used}], got {counts}")
        weight = self.config.ewma_weight
        for j in range(1, k_used + 1):
            reached = sum(1 for a in counts if a >= j - 1)
            if reached == 0:
                break
            accepted = sum(1 for a in counts if a >= j)
            self.alphas[j - 1] += weight * (accepted / reached - self.alphas[j - 1])
