"""Cost models of a speculative step: equation 1 and the measured γ-tolerance table it reads.

Seed paper §3.1: with τ(γ) = T(1)/T(γ) the latency ratio of a target forward that carries γ
tokens per request, and δ = T_D/T(1) the drafter's per-draft cost, a step that proposes γ
drafts has speedup (equation 1)

    S = λ·τ(γ+1) / (1 + γ·δ·τ(γ+1)),

where λ, the *acceptance length*, is the expected number of tokens a step commits: accepted
drafts plus the bonus token. ``GammaTable`` holds τ measured by
``benchmarks/gamma_tolerance.py``; a ``StepCost`` (``MTPGatedLoRACost``, ``DrafterCost``) says
at which γ a method with k drafts reads τ, and what δ it pays. Pure (no SGLang); the online
controller that picks k from these is ``controller.py``.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class BudgetCost:
    """Settings that are node budgets of one verified tree per request (SPECBLOCK): setting k
    verifies ``budgets[k]`` tokens per request; the drafter's cost is measured, not modelled
    (δ = 0: only the online step times price it)."""

    budgets: tuple[int, ...]
    delta: float = 0.0

    def __post_init__(self) -> None:
        if (
            not self.budgets
            or self.budgets[0] != 1
            or list(self.budgets) != sorted(set(self.budgets))
        ):
            raise ValueError(f"budgets must rise from 1 (no drafts): {self.budgets}")

    def tokens_per_step(self, k: int) -> int:
        return self.budgets[k]
