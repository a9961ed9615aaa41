"""How many drafts a step is expected to commit, per setting of the speculation controller.

``SpeculationController`` (``controller.py``) indexes an algorithm's settings by k = 0..k_max,
ordered by cost (k = 0: no drafts), and reads λ(k), the *acceptance length* (accepted drafts
plus the bonus token), from one of these models; each is updated from the accepted-draft
counts the served steps report. Pure (no SGLang).

- ``ChainAcceptance``: k drafts in a chain (MTP_LORA's masks, a draft model's chain): the
  conditional acceptance α_j of each position, so that what is observed at one k predicts
  another.
- ``BudgetAcceptance``: settings that are budgets of one drafter's proposals (SPECBLOCK's tree
  node budgets): the accepted drafts of each budget are observed while it runs (and a smaller
  budget's on the same steps, read off the larger tree), the others follow by the ratios
  learnt on the steps that observed both, and a larger budget is expected to accept no fewer
  (its tree keeps the smaller one's best nodes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class AcceptanceModel(Protocol):
    def length(self, k: int) -> float:
        """λ(k): 1 (the bonus token) + the expected number of accepted drafts at setting k."""
        ...

    def most_accepted(self, k: int) -> int:
        """The most drafts one request can accept in a step at setting k."""
        ...

    def population_length(self, k: int) -> float:
        """λ(k) of the requests served so far, not only of those in the batch now."""
        ...

    def observe(self, k: int, counts: Sequence[int]) -> None:
        """One step at setting k accepted ``counts[i]`` drafts for request i."""
        ...

    def spread(self, k: int) -> float | None:
        """The standard deviation of one request's accepted drafts in a step at setting k over
        the recent requests served (``RequestSpread``), or None before ``SPREAD_MIN_STEPS``
        steps observed it."""
        ...

    def renew(self, share: float) -> None:
        """``share`` of the batch's requests are new since the estimates were last renewed."""
        ...

    def reopen(self) -> None:
        """A probe starts while speculation is off: the estimates are as old as the last step
        that drafted."""
        ...


# A chain's population estimate (``ChainAcceptance``) weighs one step's observation 1/n over its
# first n observations of a position (a running mean: no pull from the prior), then this much:
# it spans a few requests' worth of steps where the running α follows the requests in the batch.
POPULATION_WEIGHT = 0.01
# Weight of a step in ``BudgetAcceptance``'s ratios between budgets (after a running mean over
# the first steps): they move over tens of steps, while each budget's estimate follows the
# requests within a few.
RATIO_WEIGHT = 0.05
# Observations of a position before its population estimate may renew the running one: fewer
# would only come from the first request's warm-up probes.
POPULATION_MIN_SEEN = 64


# Steps observed at a setting before its measured spread (``RequestSpread``) is used.
SPREAD_MIN_STEPS = 16


class RequestSpread:
    """Per setting, the running first and second moments of one request's accepted drafts in
    a step, over the requests served (a running mean over the first steps, then an EWMA of
    ``POPULATION_WEIGHT``): their standard deviation says how far the mean of a batch of n
    requests plausibly strays from the population's (``SpeculationController.plausible_length``)."""

    def __init__(self, num_settings: int) -> None:
        self.moments = [[0.0, 0.0, 0] for _ in range(num_settings)]  # mean, mean square, steps

    def observe(self, k: int, counts: Sequence[int]) -> None:
        if not counts or k <= 0:
            return
        moments = self.moments[k]
        moments[2] += 1
        pull = max(POPULATION_WEIGHT, 1.0 / moments[2])
        moments[0] += pull * (sum(counts) / len(counts) - moments[0])
        moments[1] += pull * (sum(a * a for a in counts) / len(counts) - moments[1])

    def spread(self, k: int) -> float | None:
        mean, square, steps = self.moments[k]
        if steps < SPREAD_MIN_STEPS:
            return None
        return max(square - mean * mean, 0.0) ** 0.5


def _chain_length(alphas: Sequence[float]) -> float:
    """1 + Σ_i Π_{j≤i} α_j: the bonus token plus the expected accepted drafts of a chain."""
    lam, survive = 1.0, 1.0
    for alpha in alphas:
        survive *= alpha
        lam += survive
    return lam


class ChainAcceptance:
    """α_j = P(draft j accepted | drafts 1..j-1 were), one running estimate per position;
    λ(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j. A position beyond the k in use is not observed and keeps
    its last estimate.

    Acceptance is a property of the requests: next to the running α (EWMA ``weight``, the
    requests in the batch now) a slower estimate (``POPULATION_WEIGHT``) follows the requests
    served. When requests join, ``renew`` moves α toward it by their share of the batch: a new
    request is expected to accept like the population, not like the one it replaced (at one
    request, one whose drafts were rejected would otherwise leave α low and drafting off for
    the next ones, whose short probes barely move an EWMA of weight 0.05). A position renews
    only once the population estimate has ``POPULATION_MIN_SEEN`` observations of it."""

    def __init__(self, prior: Sequence[float], weight: float) -> None:
        self.alphas = [float(a) for a in prior]
        self.population = list(self.alphas)
        self.seen = [0] * len(self.alphas)  # observations of each position
        self.weight = weight
        self.spreads = RequestSpread(len(self.alphas) + 1)

    def length(self, k: int) -> float:
        return _chain_length(self.alphas[:k])

    def population_length(self, k: int) -> float:
        return _chain_length(self.population[:k])

    def most_accepted(self, k: int) -> int:
        return k

    def spread(self, k: int) -> float | None:
        return self.spreads.spread(k)

    def observe(self, k: int, counts: Sequence[int]) -> None:
        """Draft j was *reached* when drafts 1..j-1 were accepted; α_j moves toward the fraction
        of reaching requests that accepted it, one EWMA step per call."""
        self.spreads.observe(k, counts)
        for j in range(1, k + 1):
            reached = sum(1 for a in counts if a >= j - 1)
            if reached == 0:
                break
            accepted = sum(1 for a in counts if a >= j)
            self.alphas[j - 1] += self.weight * (accepted / reached - self.alphas[j - 1])
            self.seen[j - 1] += 1
            pull = max(POPULATION_WEIGHT, 1.0 / self.seen[j - 1])
            self.population[j - 1] += pull * (accepted / reached - self.population[j - 1])

    def renew(self, share: float) -> None:
        share = min(max(share, 0.0), 1.0)
        for j, (alpha, population) in enumerate(zip(self.alphas, self.population, strict=True)):
            if self.seen[j] >= POPULATION_MIN_SEEN:
                self.alphas[j] = alpha + share * (population - alpha)

    def reopen(self) -> None:
        """Nothing: a probe's steps enter the per-position EWMA like any others (``renew``
        already moves α toward the population when requests join)."""


class BudgetAcceptance:
    """One running mean of accepted drafts per request for each setting k (a budget of
    ``max_drafts[k]`` acceptable drafts at most; ``max_drafts[0]`` is 0). Before a setting is
    observed its estimate is ``prior[k]`` (the accepted drafts expected there). λ(k) is the
    largest estimate among settings 0..k, plus 1: a larger budget keeps at least the smaller
    one's drafts, so it cannot be expected to accept fewer.

    A larger budget not observed on a step follows the largest observed one by their ratio,
    learnt slowly (``RATIO_WEIGHT``) on the steps that observed both (``paired``; a step at
    budget j observes every budget <= j, its tree's best nodes). How well drafts are accepted
    moves with the requests, within a few steps; how the budgets compare moves slowly, and a
    smaller budget's own movement says little of a larger one's (budget 2's one draft is
    accepted on most steps whether budget 8 accepts 2 drafts or 4)."""

    def __init__(
        self,
        max_drafts: Sequence[int],
        prior: Sequence[float],
        weight: float,
        request_weight: float | None = None,
    ) -> None:
        if len(prior) != len(max_drafts) or not max_drafts or max_drafts[0] != 0:
            raise ValueError(
                f"need one prior per setting and setting 0 without drafts: {max_drafts}, {prior}"
            )
        if any(not 0 <= p <= m for p, m in zip(prior, max_drafts, strict=True)):
            raise ValueError(f"prior accepted drafts must lie in [0, max_drafts]: {prior}")
        self.max_drafts = [int(m) for m in max_drafts]
        self.estimates = [float(p) for p in prior]
        self.num_observed = [0] * len(prior)
        self.weight = weight
        self.request_weight = request_weight
        self.spreads = RequestSpread(len(prior))
        # (j, k), j > k: [mean count of budget j, of budget k, steps] over the steps that
        # observed both
        self.paired: dict[tuple[int, int], list] = {}

    def length(self, k: int) -> float:
        return 1.0 + max(self.estimates[: k + 1])

    def population_length(self, k: int) -> float:
        """The running estimate: it already follows the requests served within a few steps."""
        return self.length(k)

    def most_accepted(self, k: int) -> int:
        return self.max_drafts[k]

    def spread(self, k: int) -> float | None:
        return self.spreads.spread(k)

    def renew(self, share: float) -> None:
        """Nothing: each budget's estimate already follows within a few steps (its EWMA weight
        is 0.25 in the served tuning) and the probes on turnover re-measure it."""
        del share

    def reopen(self) -> None:
        """Speculation was off: the estimates are as old as the last step that drafted. The
        next observations (a probe's) average with each estimate as with one observation,
        then the EWMA takes over again."""
        self.num_observed = [min(n, 1) for n in self.num_observed]

    def step_weight(self, num_requests: int) -> float:
        """An observed step's weight in the running estimates: ``weight``, or with
        ``request_weight`` that much per request the step observed, up to ``weight`` (one
        request's accepted drafts vary far more from step to step than a batch's mean)."""
        if self.request_weight is None:
            return self.weight
        return min(self.weight, self.request_weight * max(num_requests, 1))

    def ratio(self, j: int, k: int) -> float | None:
        """Budget j's expected count over budget k's, j > k, from the steps that observed both;
        None before any, or where budget k's is 0 there (nothing to scale by)."""
        pair = self.paired.get((j, k))
        return pair[0] / pair[1] if pair is not None and pair[1] > 0 else None

    def observe(self, k: int, counts: Sequence[int]) -> None:
        self.observe_settings({k: counts})

    def observe_settings(self, observed: Mapping[int, Sequence[int]]) -> None:
        """One step's accepted drafts per request at each setting in ``observed``: the setting
        it ran, and possibly smaller ones read off its tree (each budget's best-scoring nodes,
        ``prune_to_budget``), so that the budgets' ratios are learnt on the same steps. A
        larger budget not observed follows the largest observed one by their ratio (class
        docstring); before any step observed both, and for the smaller ones not observed, by
        the factor the largest observed one moved."""
        seen = sorted(k for k, counts in observed.items() if counts and k > 0)
        if not seen:
            return
        means = {k: sum(observed[k]) / len(observed[k]) for k in seen}
        factor = None
        for k in seen:
            self.spreads.observe(k, observed[k])
            moved = self._update(k, means[k], len(observed[k]))
            if moved is not None:
                factor = moved
        for i, j in enumerate(seen):  # the pairs this step observed
            for k in seen[:i]:
                pair = self.paired.setdefault((j, k), [0.0, 0.0, 0])
                pair[2] += 1
                pull = max(RATIO_WEIGHT, 1.0 / pair[2])
                pair[0] += pull * (means[j] - pair[0])
                pair[1] += pull * (means[k] - pair[1])
        top = seen[-1]
        for j in range(1, len(self.estimates)):
            if j in means:
                continue
            ratio = self.ratio(j, top) if j > top else None
            if ratio is not None:
                self.estimates[j] = min(self.estimates[top] * ratio, self.max_drafts[j])
            elif factor is not None and self.num_observed[j]:
                # how well drafts are accepted moves with the requests, at every budget alike
                self.estimates[j] = min(self.estimates[j] * factor, self.max_drafts[j])

    def _update(self, k: int, mean: float, num_requests: int) -> float | None:
        """Move setting k's estimate toward ``mean``; the factor it moved by, or None where
        that says nothing (a first observation, a zero estimate)."""
        self.num_observed[k] += 1
        # the prior is only a guess: the first observations are averaged (the first replaces
        # it), later ones enter as an EWMA of ``step_weight``
        weight = max(self.step_weight(num_requests), 1.0 / self.num_observed[k])
        before = self.estimates[k]
        self.estimates[k] += weight * (mean - before)
        if before > 0 and self.num_observed[k] > 1:
            return self.estimates[k] / before
        return None
