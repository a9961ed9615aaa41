"""MINEDRAFT serving metrics, logged by the worker.

A *phase* is one MineDraft SD step (paper §5.2): the target verifies one batch while the draft
server drafts the other, up to the sync point. The worker logs ``summary()`` every
``--decode-log-interval`` phases. Per phase we record

- ``verify_s``: the target's verify forward (packing included), on the scheduler's device;
- ``draft_s``: the draft server's own drafting time for the other batch (``DraftResult``);
- ``wait_s``: how long the scheduler blocked at the sync point after its verify;
- ``overlap_s``: the time both were busy, ``min(verify_s, draft_s)`` (both start at submit);
- ``parallel``: both batches were non-empty (coverage, App. C.12, is their share).

Acceptance length τ = 1 + accepted drafts per verified request, as SGLang's
``spec_accept_length``. The overlap bound of the issue, (T_draft + T_verify) / max(T_draft,
T_verify), is computed from the parallel phases' sums.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MineDraftStats:
    phases: int = 0
    parallel_phases: int = 0
    verified: int = 0  # request-verifies
    accepted: int = 0  # accepted drafts
    undrafted: int = 0  # request-verifies without drafts
    verify_s: float = 0.0
    draft_s: float = 0.0
    wait_s: float = 0.0
    overlap_s: float = 0.0
    parallel_verify_s: float = 0.0
    parallel_draft_s: float = 0.0

    def record_phase(
        self,
        *,
        parallel: bool,
        num_verified: int,
        num_accepted: int,
        num_undrafted: int,
        verify_s: float,
        draft_s: float,
        wait_s: float,
    ) -> None:
        self.phases += 1
        self.verified += num_verified
        self.accepted += num_accepted
        self.undrafted += num_undrafted
        self.verify_s += verify_s
        self.draft_s += draft_s
        self.wait_s += wait_s
        if parallel:
            self.parallel_phases += 1
            self.overlap_s += min(verify_s, draft_s)
            self.parallel_verify_s += verify_s
            self.parallel_draft_s += draft_s

    @property
    def accept_length(self) -> float:
        return 1 + self.accepted / max(self.verified, 1)

    @property
    def coverage(self) -> float:
        return self.parallel_phases / max(self.phases, 1)

    @property
    def overlap_bound(self) -> float:
        """(T_draft + T_verify) / max(T_draft, T_verify) over the parallel phases."""
        longest = max(self.parallel_draft_s, self.parallel_verify_s)
        return (self.parallel_draft_s + self.parallel_verify_s) / longest if longest else 1.0

    def summary(
        self, faults: int, restarts: int, balance: int, moved: int, catch_ups: int = 0
    ) -> str:
        n = max(self.phases, 1)
        return (
            f"MINEDRAFT: steps={self.phases} parallel_steps={self.parallel_phases}"
            f" coverage={self.coverage:.3f}"
            f" mean_accept_length={self.accept_length:.3f}"
            f" draft_ms={1e3 * self.draft_s / n:.2f} verify_ms={1e3 * self.verify_s / n:.2f}"
            f" overlap_ms={1e3 * self.overlap_s / n:.2f} wait_ms={1e3 * self.wait_s / n:.2f}"
            f" overlap_bound={self.overlap_bound:.3f} undrafted={self.undrafted}"
            f" faults={faults} restarts={restarts} balance={balance} moved={moved}"
            f" catch_ups={catch_ups}"
        )
