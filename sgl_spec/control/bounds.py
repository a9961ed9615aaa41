"""What ``SpeculationController`` may assume of a setting it has not measured: an upper bound on
its τ from the step times it has (``tau_bound``), which cheaper setting to measure first so that
the bound tightens (``cheaper_first``), and the acceptance a batch plausibly has
(``plausible_length``). Pure.
"""

from __future__ import annotations

import math

from sgl_spec.control.acceptance import AcceptanceModel
from sgl_spec.control.cost_model import StepCost
from sgl_spec.control.step_times import StepTimes

# The bound on T(k) from the ratio of extra costs at a smaller batch (``tau_bound``) allows for
# that ratio to come out this much smaller at the larger batch (noise in the five step times
# it is read from).
SHAPE_SLACK = 1.5


def tau_bound(times: StepTimes, cost: StepCost, batch_size: int, k: int, t0: float) -> float:
    """An upper bound on τ(k) where T(0) = ``t0`` is measured but T(k) is not: T(k) >= T(j)
    for every j < k, so τ(k) <= τ(j) for every j <= k known here or, not yet measured here, at
    a smaller batch size; and where j is measured here, T(k) - T(0) is at least (T(j) - T(0))
    times their ratio at a smaller batch (``StepTimes.extra_ratio_from_smaller_batch``), up to
    the ratio of their extra tokens, over ``SHAPE_SLACK``. A setting j <= k that a probe has
    begun to measure here bounds it by its first samples (``StepTimes.provisional``: T(k) >=
    T(j), a probe's evidence before it counts as measured). The tightest bound counts."""
    tau = 1.0
    base = cost.tokens_per_step(0)
    for j in range(1, k + 1):
        early = times.provisional(batch_size, j)
        if early is not None:
            tau = min(tau, t0 / early)
        tj = times.get(batch_size, j) if j < k else None
        if tj is None:
            bound = times.tau_from_smaller_batch(batch_size, j)
            tau = tau if bound is None else min(tau, bound)
            continue
        tau = min(tau, t0 / tj)
        ratio = times.extra_ratio_from_smaller_batch(batch_size, j, k)
        if ratio is not None and tj > t0 and cost.tokens_per_step(j) > base:
            tokens = (cost.tokens_per_step(k) - base) / (cost.tokens_per_step(j) - base)
            least = t0 + (tj - t0) * min(ratio, tokens) / SHAPE_SLACK
            tau = min(tau, t0 / least)
    return tau


def cheaper_first(times: StepTimes, batch_size: int, k: int) -> int:
    """The smallest setting i < k not measured at this batch size whose time, once measured,
    bounds T(k) by how the two compared at a smaller batch (``tau_bound``), else k: a probe of
    i costs less than one of k, and may show that k is not worth one. Also where that ratio is
    near 1 (a bound no tighter than T(k) >= T(i)): probing only where it exceeded the slack
    served slower at 16 requests (RESULTS.md, 2026-12-04)."""
    for i in range(1, k):
        if times.get(batch_size, i) is None and (
            times.extra_ratio_from_smaller_batch(batch_size, i, k) is not None
        ):
            return i
    return k


def plausible_length(acceptance: AcceptanceModel, k: int, batch_size: int) -> float:
    """The largest acceptance length a batch of n = ``batch_size`` requests plausibly has at
    setting k: the population's λ(k) plus the larger of two standard deviations of a mean of n
    requests -- one request's measured once enough steps observed k (``AcceptanceModel.spread``),
    before that its largest possible for counts between 0 and most_accepted(k), half that range
    (Popoviciu) -- and one request unlike those measured accepting every draft,
    most_accepted(k) / n; up to the full range (one request may accept anything)."""
    most = acceptance.most_accepted(k)
    largest = most / 2
    measured = acceptance.spread(k)
    deviation = largest if measured is None else min(measured, largest)
    n = max(batch_size, 1)
    spread = max(2 * deviation / math.sqrt(n), most / n)
    return min(1.0 + most, acceptance.population_length(k) + spread)
