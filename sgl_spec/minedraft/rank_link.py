"""The draft server as every tensor-parallel rank of a MINEDRAFT replica sees it.

With ``--tp-size N`` each rank's scheduler runs a ``MineDraftWorker`` on its shard of the
target, and all of them must verify the same drafts (the verify forward's collectives meet
only if every rank runs the same tree). One draft server per replica is enough (paper §5: the
target on N devices, the drafter on one more): rank 0 starts it, sends it the jobs and collects
its drafts; at every collect the drafts rank 0 accepted (or None: a fault, a late reply, no
server) go to every rank with one broadcast over the group's CPU channel
(``GroupCoordinator.broadcast_object``). The other ranks hold no link. The jobs every rank
builds are the same (same batch, same plan, same drafts), so only rank 0's travel.

With one rank there is no broadcast: the link is rank 0's alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sgl_spec.minedraft.link import DraftJob, DraftLink

Drafts = dict[str, tuple[int, np.ndarray]]


class RankedLink:
    """``link`` on tensor rank 0 (None on the others); ``group`` SGLang's tensor-parallel
    GroupCoordinator, or None with one rank. Drafts are checked (ids in the vocabulary, at
    most ``max_len`` per request) on rank 0 before they are shared."""

    def __init__(self, link: DraftLink | None, group: Any, vocab_size: int, max_len: int) -> None:
        if link is None and group is None:
            raise ValueError("a single rank must hold the draft link")
        self.link = link
        self.group = group
        self.vocab_size = vocab_size
        self.max_len = max_len

    @property
    def num_faults(self) -> int:
        return 0 if self.link is None else self.link.num_faults

    @property
    def num_restarts(self) -> int:
        return 0 if self.link is None else self.link.num_restarts

    def on_restart(self, callback: Callable[[int], None]) -> None:
        """``callback(running total)`` after each draft-server restart (rank 0's server)."""
        if self.link is not None:
            self.link.on_restart = callback

    @property
    def num_catch_ups(self) -> int:
        return 0 if self.link is None else self.link.num_catch_ups

    def lag(self, rid: str, total: int) -> int:
        """Tokens rank 0's server lacks of ``rid`` (0 on the other ranks: nothing to send)."""
        return 0 if self.link is None else self.link.lag(rid, total)

    def catch_up(self, step_id: int, jobs: Sequence[DraftJob]) -> bool:
        """Rank 0 sends ``jobs`` unawaited (``DraftLink.catch_up``); no rank waits for them,
        so nothing is shared."""
        return self.link is not None and self.link.catch_up(step_id, jobs)

    def removed(self, rids: Sequence[str]) -> None:
        if self.link is not None:
            self.link.removed(rids)

    def submit(self, step_id: int, batch_id: int, jobs: Sequence[DraftJob]) -> bool:
        """Send ``jobs`` (rank 0). True on every rank of a group: whether drafts come back is
        known only at ``collect``, which every rank then calls."""
        sent = self.link is not None and self.link.submit(step_id, batch_id, jobs)
        return sent or self.group is not None

    def collect(self, step_id: int) -> tuple[Drafts, float] | None:
        """Step ``step_id``'s checked drafts and the server's drafting time, the same on every
        rank; None when rank 0 has none to give."""
        got = None
        if self.link is not None:
            got = self.link.collect(step_id)
            if got is not None and not self.link.check_output(
                got[0], self.vocab_size, self.max_len
            ):
                got = None
        if self.group is not None:
            got = self.group.broadcast_object(got, src=0)
        return got

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
