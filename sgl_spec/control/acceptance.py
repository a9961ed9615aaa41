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
  budget's on the same steps, read off the larger tree), a change seen at one budget moves the
  others by the same factor, and a larger budget is expected to accept no fewer (its tree keeps
  the smaller one's best nodes).
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

    def renew(self, share: float) -> None:
        """``share`` of the batch's requests are new since the estimates were last renewed."""
        ...


# A chain's population estimate (``ChainAcceptance``) weighs one step's observation 1/n over its
# first n observations of a position (a running mean: no pull from the prior), then this much:
# it spans a few requests' worth of steps where the running α follows the requests in the batch.
POPULATION_WEIGHT = 0.01
# Observations of a position before its population estimate may renew the running one: fewer
# would only come from the first request's warm-up probes.
POPULATION_MIN_SEEN = 64


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

    def length(self, k: int) -> float:
        return _chain_length(self.alphas[:k])

    def population_length(self, k: int) -> float:
        return _chain_length(self.population[:k])

    def most_accepted(self, k: int) -> int:
        return k

    def observe(self, k: int, counts: Sequence[int]) -> None:
        """Draft j was *reached* when drafts 1..j-1 were accepted; α_j moves toward the fraction
        of reaching requests that accepted it, one EWMA step per call."""
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


class BudgetAcceptance:
    """One running mean of accepted drafts per request for each setting k (a budget of
    ``max_drafts[k]`` acceptable drafts at most; ``max_drafts[0]`` is 0). Before a setting is
    observed its estimate is ``prior[k]`` (the accepted drafts expected there). λ(k) is the
    largest estimate among settings 0..k, plus 1: a larger budget keeps at least the smaller
    one's drafts, so it cannot be expected to accept fewer."""

    def __init__(self, max_drafts: Sequence[int], prior: Sequence[float], weight: float) -> None:
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

    def length(self, k: int) -> float:
        return 1.0 + max(self.estimates[: k + 1])

    def population_length(self, k: int) -> float:
        """The running estimate: it already follows the requests served within a few steps."""
        return self.length(k)

    def most_accepted(self, k: int) -> int:
        return self.max_drafts[k]

    def renew(self, share: float) -> None:
        """Nothing: each budget's estimate already follows within a few steps (its EWMA weight
        is 0.25 in the served tuning) and the probes on turnover re-measure it."""
        del share

    def observe(self, k: int, counts: Sequence[int]) -> None:
        self.observe_settings({k: counts})

    def observe_settings(self, observed: Mapping[int, Sequence[int]]) -> None:
        """One step's accepted drafts per request at each setting in ``observed``: the setting
        it ran, and possibly smaller ones read off its tree (each budget's best-scoring nodes,
        ``prune_to_budget``), so that the ratios between budgets are learnt on the same steps.
        The settings not observed follow the largest observed one by the same factor."""
        factor = None
        for k in sorted(observed):
            moved = self._update(k, observed[k])
            if moved is not None:
                factor = moved
        if factor is None:
            return
        # How well drafts are accepted moves with the requests served, at every budget alike:
        # the others follow by the same factor (each keeps its ratio to the observed ones, learnt
        # while they ran).
        for j in range(1, len(self.estimates)):
            if j not in observed and self.num_observed[j]:
                self.estimates[j] = min(self.estimates[j] * factor, self.max_drafts[j])

    def _update(self, k: int, counts: Sequence[int]) -> float | None:
        """Move setting k's estimate toward the mean of ``counts``; the factor it moved by, or
        None where that says nothing (no counts, k = 0, a first observation, a zero estimate)."""
        if not counts or k == 0:
            return None
        # The prior is only a guess: the first observations are averaged (the first replaces
        # it), later ones enter as an EWMA of weight ``weight``.
        self.num_observed[k] += 1
        weight = max(self.weight, 1.0 / self.num_observed[k])
        mean = sum(counts) / len(counts)
        before = self.estimates[k]
        self.estimates[k] += weight * (mean - before)
        if before > 0 and self.num_observed[k] > 1:
            return self.estimates[k] / before
        return None
