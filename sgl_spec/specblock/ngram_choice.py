"""Whether a SPECBLOCK step with an n-gram branch runs the drafter at all (``ngram_branch.py``).

Where the corpus matches deeply, its tree alone may accept about as much as the drafter's tree
merged with it, and a step without the drafter's tree forwards costs less (the drafter reads
its tokens later, with the next drafting step's). Per step the choice maximises expected tokens per
second from what merged steps measure, with nothing assumed per host:

- per request, the *match depth* of its n-gram tree (0: no match) buckets the statistics;
- a merged step shows, per request, how many drafts it accepted, and how many of those the
  n-gram tree alone held (the accepted tokens walked down it from its root, ``ngram_holds``);
  a step without the drafter shows the second directly;
- the step time of each kind, per batch size (a step without the drafter is predicted as a
  merged step less its drafting until one is measured).

Decayed averages follow changes in the text. So that the merged figures stay current, a run of
steps that would skip the drafter runs it once after ``EXPLORE_FIRST`` of them, then after twice
as many each time, up to ``EXPLORE_MAX``; a step that drafts by choice starts over. Each such
step costs a full drafting step -- the drafter first reads every token the skipped steps
committed -- so where the n-grams keep winning it comes ever more rarely.
"""

from __future__ import annotations

from collections.abc import Sequence

DECAY = 0.99  # per observation: the averages follow the last ~100 observations
MIN_WEIGHT = 3.0  # observations (decayed) before an average is used
EXPLORE_FIRST = 16  # would-skip steps before the first exploring one
EXPLORE_MAX = 256  # ... and at most this many between two


class _Mean:
    __slots__ = ("total", "weight")

    def __init__(self) -> None:
        self.total = 0.0
        self.weight = 0.0

    def add(self, value: float) -> None:
        self.total = self.total * DECAY + value
        self.weight = self.weight * DECAY + 1.0

    @property
    def known(self) -> bool:
        return self.weight >= MIN_WEIGHT

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight else 0.0


class DrafterChoice:
    """Statistics per match-depth bucket and per batch size; ``skips`` decides a step."""

    def __init__(self, num_buckets: int) -> None:
        self.accepted_merged = [_Mean() for _ in range(num_buckets)]
        self.accepted_ngram = [_Mean() for _ in range(num_buckets)]
        self._times: dict[int, tuple[_Mean, _Mean, _Mean]] = {}  # merged, drafting, without
        self._would_skip = 0  # would-skip steps since the last drafting one
        self._explore_after = EXPLORE_FIRST
        self.skipped = 0  # steps run without the drafter (for the log line)

    def _times_at(self, batch_size: int) -> tuple[_Mean, _Mean, _Mean]:
        if batch_size not in self._times:
            self._times[batch_size] = (_Mean(), _Mean(), _Mean())
        return self._times[batch_size]

    def skips(self, buckets: Sequence[int]) -> bool:
        """Whether this step (one bucket per request) is expected to yield more tokens per
        second from the n-gram trees alone than from the merged trees."""
        merged_s, drafting_s, without_s = self._times_at(len(buckets))
        if not merged_s.known or not drafting_s.known:
            return False
        tokens_merged = tokens_ngram = 0.0
        for b in buckets:
            merged, ngram = self.accepted_merged[b], self.accepted_ngram[b]
            if not merged.known or not ngram.known:
                return False
            tokens_merged += 1.0 + merged.value
            tokens_ngram += 1.0 + ngram.value
        step_without = without_s.value if without_s.known else merged_s.value - drafting_s.value
        if tokens_ngram * merged_s.value <= tokens_merged * max(step_without, 1e-9):
            self._would_skip, self._explore_after = 0, EXPLORE_FIRST
            return False
        self._would_skip += 1
        if self._would_skip < self._explore_after:
            return True
        self._would_skip = 0
        self._explore_after = min(2 * self._explore_after, EXPLORE_MAX)
        return False

    def observe(
        self,
        buckets: Sequence[int],
        skipped: bool,
        accepted: Sequence[int],  # drafts accepted per request
        accepted_ngram: Sequence[int],  # of which the n-gram tree alone held (leading)
        step_s: float,
        drafting_s: float,
    ) -> None:
        merged_s, drafting, without_s = self._times_at(len(buckets))
        if skipped:
            self.skipped += 1
            without_s.add(step_s)
        else:
            merged_s.add(step_s)
            drafting.add(drafting_s)
        for b, n_all, n_ngram in zip(buckets, accepted, accepted_ngram, strict=True):
            if not skipped:
                self.accepted_merged[b].add(float(n_all))
            self.accepted_ngram[b].add(float(n_ngram))
