"""The scheduler's supervised link to the draft server: what it holds, faults, restarts.

``DraftLink`` wraps ``DraftServerClient`` with the bookkeeping the worker needs each step:

* which tokens of each request the server already holds (``DraftEntry.appended_ids`` carries
  only the new ones; a new or re-sent request carries its whole sequence as the prompt);
* the requests that left since the last submit (``DraftRequest.removed_rids``);
* fault handling: an exit, a fatal report, a malformed frame, or no reply at
  all for ``timeout_s`` while drafts are awaited (hung) marks the link down. The step goes on
  target-only (the caller gets no drafts), a background thread restarts the server (with a
  growing back-off while starts fail), and once it is back every request is re-sent with its
  prompt. Nothing here raises into the serving loop.
* bounded waits: a sync point waits for its drafts at most ``max(SOFT_WAIT_FLOOR_S,
  SOFT_WAIT_FACTOR x`` the slowest recent drafting time the server reported``)``, then its
  batch is verified without drafts; until the server replies again, later sync points do
  not wait at all. So a hung server costs one short wait, not ``timeout_s`` per step, and a
  late reply is dropped as stale (the server still holds the tokens it was sent: results
  come in order).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sgl_spec.minedraft.messages import DraftEntry, DraftRequest

logger = logging.getLogger(__name__)
RESTART_BACKOFF_S = (1.0, 5.0, 15.0, 30.0)
SOFT_WAIT_FLOOR_S = 1.0  # a sync point waits at least this long for its drafts
SOFT_WAIT_FACTOR = 4.0  # ... or this many times the slowest recent drafting time
MAX_CATCH_UPS = 2  # catch-up jobs (``DraftLink.catch_up``) unanswered at once


@dataclass(frozen=True)
class DraftJob:
    """One request to draft: its whole verified sequence (prompt + outputs, the last token
    being the root of the next verify). Only ``tokens[sent:]`` travels."""

    rid: str
    tokens: Sequence[int]
    prompt_len: int
    # SpecBlock drafter: ``features(start, end)`` gives the target's feature rows of positions
    # start..end-1; every token but the newest (the next root) has them. None: a draft LM.
    features: Callable[[int, int], np.ndarray] | None = None

    def feature_rows(self, start: int) -> np.ndarray | None:
        """Rows of positions ``start`` up to the newest token (excluded); None when there are
        none to give (the draft server then never drafts this request: target-only, lossless)."""
        if self.features is None:
            return None
        try:
            return self.features(start, len(self.tokens) - 1)
        except Exception:
            logger.exception("MINEDRAFT: reading %s's target features failed", self.rid)
            return None


class DraftLink:
    def __init__(self, client, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self._sent: dict[str, int] = {}  # rid -> tokens the server holds
        self._removed: list[str] = []
        self._pending: dict[int, dict[str, int]] = {}  # step id -> rid -> drafted seq len
        self._lock = threading.Lock()
        self._up = False
        self._restarting = False
        self._generation_seen = 0
        self._reset_waits()
        self.num_faults = 0
        self.num_restarts = 0
        self.num_catch_ups = 0  # catch-up jobs sent (``catch_up``)
        self.last_fault = ""
        self.on_restart: Callable[[int], None] | None = None  # given the running total

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server synchronously (start-up: a failure is the user's to see)."""
        self.client.start()
        self._generation_seen = self.client.generation
        self._up = True

    @property
    def up(self) -> bool:
        with self._lock:
            if not self._up or self._restarting:
                return False
        if self.client.generation != self._generation_seen:  # a restart finished
            self._generation_seen = self.client.generation
            self._sent.clear()
            self._removed.clear()
            self._pending.clear()
            self._reset_waits()
        return True

    def _reset_waits(self) -> None:
        self._unanswered: deque[bool] = deque()  # per job sent, in submit order: awaited?
        self._silent_since: float | None = None  # awaited, unanswered, and no reply since then
        self._draft_s = 0.0  # slowest recent drafting time (decays), or a wait in vain
        self._late = False  # a sync point gave up waiting; the server has not replied since

    @property
    def _num_unanswered(self) -> int:
        """Awaited jobs without a reply yet."""
        return sum(self._unanswered)

    def close(self) -> None:
        with self._lock:
            self._up = False
        self.client.close()

    def fault(self, reason: str) -> None:
        """Mark the server unusable and restart it in the background (idempotent while a
        restart is under way)."""
        with self._lock:
            self.num_faults += 1
            self.last_fault = reason
            self._up = False
            if self._restarting:
                return
            self._restarting = True
        logger.warning(
            "MINEDRAFT: draft server fault (%s); decoding target-only, restarting", reason
        )
        self._pending.clear()
        threading.Thread(target=self._restart_loop, name="minedraft-restart", daemon=True).start()

    def _restart_loop(self) -> None:
        attempt = 0
        while True:
            try:
                self.client.restart()
                break
            except Exception as exc:
                wait = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                logger.warning(
                    "MINEDRAFT: draft server restart failed (%s); retry in %.0fs", exc, wait
                )
                attempt += 1
                time.sleep(wait)
        with self._lock:
            self.num_restarts += 1
            self._restarting = False
            self._up = True
        if self.on_restart is not None:
            self.on_restart(self.num_restarts)
        logger.info(
            "MINEDRAFT: draft server restarted (pid %s); parallel mode resumes", self.client.pid
        )

    # -- steps -------------------------------------------------------------------------------

    def removed(self, rids: Sequence[str]) -> None:
        """Requests that left the batch: the server frees them with the next submit."""
        for rid in rids:
            if self._sent.pop(rid, None) is not None:
                self._removed.append(rid)

    def lag(self, rid: str, total: int) -> int:
        """Tokens of a ``total``-token sequence the server does not hold yet (all if new)."""
        sent = self._sent.get(rid)
        return total if sent is None or sent > total else total - sent

    def catch_up(self, step_id: int, jobs: Sequence[DraftJob]) -> bool:
        """Send the server these requests' new tokens without waiting for what it drafts from
        them: between drafted steps, so that the next drafted step only appends a few. Sent only
        while fewer than ``MAX_CATCH_UPS`` such jobs are unanswered (never piled up behind a
        slow server), and only while no drafts are awaited; their results arrive before the
        next awaited one and are dropped as stale there."""
        if not jobs or self._pending or not self.up:
            return False
        num_stale = self.client.num_stale
        try:  # take the results that came back meanwhile (non-blocking)
            self.client.collect(0.0, step_id=-1)
        except Exception as exc:
            self.fault(f"collect failed: {exc}")
            return False
        self._answered(self.client.num_stale - num_stale)
        catch_ups = len(self._unanswered) - self._num_unanswered
        if catch_ups >= MAX_CATCH_UPS or not self.submit(step_id, 0, jobs, awaited=False):
            return False
        self.num_catch_ups += 1
        return True

    def submit(
        self, step_id: int, batch_id: int, jobs: Sequence[DraftJob], awaited: bool = True
    ) -> bool:
        """Send one draft batch; False (and a fault) if the server cannot take it. A batch not
        ``awaited`` (``catch_up``) is never collected: no wait, no hang detection."""
        if not self.up:
            return False
        entries = []
        for job in jobs:
            sent = self._sent.get(job.rid)
            total = len(job.tokens)
            if sent is None or sent > total:
                prompt = np.asarray(job.tokens, dtype=np.int32)
                entries.append(
                    DraftEntry(
                        job.rid,
                        np.zeros(0, np.int32),
                        total,
                        prompt_ids=prompt,
                        features=job.feature_rows(0),
                    )
                )
            else:
                appended = np.asarray(job.tokens[sent:], dtype=np.int32)
                rows = job.feature_rows(max(sent - 1, 0))
                entries.append(DraftEntry(job.rid, appended, total, features=rows))
            self._sent[job.rid] = total
        request = DraftRequest(step_id, batch_id, tuple(entries), tuple(self._removed))
        try:
            self.client.submit(request)
        except Exception as exc:
            self.fault(f"submit failed: {exc}")
            return False
        self._removed.clear()
        self._unanswered.append(awaited)
        if awaited:
            self._pending[step_id] = {job.rid: len(job.tokens) for job in jobs}
            if self._silent_since is None:
                self._silent_since = time.monotonic()
        return True

    def collect(self, step_id: int) -> tuple[dict[str, tuple[int, np.ndarray]], float] | None:
        """The drafts of step ``step_id`` as rid -> (sequence length they continue, ids), and
        the server's drafting time; None after a fault (then the step has no drafts)."""
        expected = self._pending.pop(step_id, None)
        if expected is None or not self.up:
            return None
        wait_s = 0.0 if self._late else self._wait_budget()
        num_stale = self.client.num_stale
        try:
            result = self.client.collect(wait_s, step_id=step_id)
        except Exception as exc:
            self.fault(f"collect failed: {exc}")
            return None
        self._answered(int(result is not None) + self.client.num_stale - num_stale)
        if result is None:
            return self._missed(wait_s)
        self._draft_s = max(float(result.draft_time_s), 0.9 * self._draft_s)
        for report in self.client.take_errors():  # dropped requests: re-send with prompt
            logger.warning("MINEDRAFT: draft server dropped %s: %s", report.rids, report.message)
            for rid in report.rids:
                self._sent.pop(rid, None)
        drafts = {}
        for out in result.outputs:
            seq_len = expected.get(out.rid)
            if seq_len is None:
                self.fault(f"draft for unknown request {out.rid!r}")
                return None
            drafts[out.rid] = (seq_len, out.draft_ids)
        return drafts, float(result.draft_time_s)

    def _wait_budget(self) -> float:
        return min(self.timeout_s, max(SOFT_WAIT_FLOOR_S, SOFT_WAIT_FACTOR * self._draft_s))

    def _answered(self, num_replies: int) -> None:
        """``num_replies`` results arrived, the oldest unanswered jobs' (results come in submit
        order): the server lives if an awaited one is among them (catch-ups never count)."""
        awaited = 0
        for _ in range(min(num_replies, len(self._unanswered))):
            awaited += self._unanswered.popleft()
        if awaited:
            self._silent_since = time.monotonic() if self._num_unanswered else None
            self._late = False

    def _missed(self, wait_s: float) -> None:
        """No drafts in time: a fault once the server has been silent for ``timeout_s``, else
        this step goes without drafts and the next ones do not wait (module docstring)."""
        silent_s = 0.0 if self._silent_since is None else time.monotonic() - self._silent_since
        if silent_s >= self.timeout_s:
            self.fault(f"no reply within {self.timeout_s:.1f}s (hung)")
            return None
        if wait_s > 0:  # waited in vain: stop waiting until the server replies, then longer
            logger.info(
                "MINEDRAFT: no drafts within %.2fs; verifying without them until the draft"
                " server replies",
                wait_s,
            )
            self._late = True
            self._draft_s = max(self._draft_s, wait_s)
        return None

    def check_output(
        self, drafts: dict[str, tuple[int, np.ndarray]], vocab_size: int, max_len: int
    ) -> bool:
        """Malformed drafts (ids out of the vocabulary, too many) are a fault, never verified."""
        for rid, (_, ids) in drafts.items():
            if len(ids) > max_len or (
                len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size)
            ):
                self.fault(f"malformed drafts for {rid!r}: {ids.tolist()[:8]}")
                return False
        return True
