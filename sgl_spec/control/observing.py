"""What a controller learns of acceptance from the steps it ran: counts per request, checked
against the setting (``AcceptanceObserver``, a base of ``SpeculationController``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any


class AcceptanceObserver:
    """Feeds a controller's ``acceptance`` model (``acceptance.py``); needs ``acceptance`` and
    ``config.k_max`` on the class that has it as a base."""

    acceptance: Any
    config: Any

    def observe(self, k_used: int, num_accepted_drafts: int | Sequence[int]) -> None:
        """Update the acceptance model from one request's accepted-draft count, or one count
        per request of a batch, at setting ``k_used``."""
        self.acceptance.observe(k_used, self._counts(k_used, num_accepted_drafts))

    def observe_settings(self, observed: Mapping[int, Sequence[int]]) -> None:
        """One step's accepted-draft counts per request at several settings: the one it ran and
        smaller ones its drafts contain (an acceptance model with ``observe_settings``, e.g.
        ``BudgetAcceptance``: SPECBLOCK's smaller node budgets are the best-scoring nodes of
        the tree it verified)."""
        settings = getattr(self.acceptance, "observe_settings", None)
        if settings is None:
            raise TypeError(f"{type(self.acceptance).__name__} observes one setting per step")
        settings({k: self._counts(k, counts) for k, counts in observed.items()})

    def _counts(self, k_used: int, num_accepted_drafts: int | Sequence[int]) -> list[int]:
        """The counts as a list, checked against setting ``k_used``."""
        one = isinstance(num_accepted_drafts, Integral)
        counts = [int(a) for a in ([num_accepted_drafts] if one else num_accepted_drafts)]
        if k_used < 0 or k_used > self.config.k_max:
            raise ValueError(f"k_used must lie in [0, {self.config.k_max}], got {k_used}")
        most = self.acceptance.most_accepted(k_used)
        if any(not 0 <= a <= most for a in counts):
            raise ValueError(f"num_accepted_drafts must lie in [0, {most}], got {counts}")
        return counts
