"""MineDraft's Batch Manager (paper §5.1) with the load-balancing fix of Appendix A.

Running requests are split into batch 0 and batch 1. In each SD step the *draft batch*
(``skip_batch``) is drafted on the draft device while the *target batch* (the other one) is
verified with the drafts produced for it in the previous step; at the sync point the roles
swap (§5.2). ``balance = size(0) - size(1)``; assign and recycle keep it in step.

Assignment policies:

* ``"paper"`` (§5.1): load-balancing assign during the first SD step only; afterwards every new
  request joins the current ``skip_batch`` so it is drafted before it is verified. Appendix A
  shows why this drifts: an abort, a preemption or a partial first step (chunked prefill)
  changes the sizes, and refills then all land in whichever batch is the draft batch at the
  time, so the imbalance is never corrected.
* ``"balanced"`` (default; Appendix A's planned fix): the load-balancing assign for *every* new
  request: it joins the smaller batch, and on a tie the draft batch (as the paper's rule would,
  so no drafting step is lost in steady state). The price, also from Appendix A, is at most one
  step per request in which it sits in the target batch without drafts; ``StepPlan.undrafted``
  lists those requests so the caller can decode them target-only and count the cost.

Fallback (§5.2): a step is run in parallel only if both batches are non-empty; otherwise the
caller runs standard SD on all running requests. Coverage (App. C.12) is the share of steps
(with at least one running request) that ran in parallel.

Pure Python: ids in, batch ids and plans out; no requests, KV pools or sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sgl_spec.minedraft.flags import MINEDRAFT_POLICIES

Policy = Literal["balanced", "paper"]
POLICIES: tuple[str, ...] = MINEDRAFT_POLICIES


@dataclass(frozen=True)
class StepPlan:
    """What one SD step does, computed from the batch state at its start (§5.2).

    ``undrafted`` are target-batch requests the previous step produced no drafts for: new
    requests the balanced policy put straight into the target batch, or every target request
    after a fallback step. If all target requests are undrafted in a parallel step, the step is
    a *start-up* step: the target batch must be drafted before it can be verified (§5.2).
    """

    step_id: int
    skip_batch: int  # id of the draft batch
    draft_rids: tuple[str, ...]  # drafted this step, verified next step
    target_rids: tuple[str, ...]  # verified this step
    undrafted: tuple[str, ...]  # subset of target_rids without drafts from the previous step

    @property
    def target_batch(self) -> int:
        return 1 - self.skip_batch

    @property
    def parallel(self) -> bool:
        """Both batches non-empty: drafting overlaps verification."""
        return bool(self.draft_rids) and bool(self.target_rids)

    @property
    def fallback(self) -> bool:
        """One batch empty, requests running: run standard SD on ``all_rids`` (§5.2)."""
        return not self.parallel and bool(self.draft_rids or self.target_rids)

    @property
    def startup(self) -> bool:
        return self.parallel and len(self.undrafted) == len(self.target_rids)

    @property
    def all_rids(self) -> tuple[str, ...]:
        return self.target_rids + self.draft_rids


@dataclass
class CoverageStats:
    """Per-step parallelization statistics (App. C.12), updated at each sync point; steps with
    no running request are not counted."""

    num_steps: int = 0
    num_parallel_steps: int = 0
    """Steps with both batches non-empty (drafting overlapped verification)."""
    num_startup_steps: int = 0
    """Parallel steps whose whole target batch had no drafts yet (``StepPlan.startup``)."""
    num_undrafted: int = 0
    """Request-steps verified without drafts in parallel steps (Appendix A's cost of the
    balanced policy, start-ups included)."""
    num_assigned: int = 0
    """Requests given a batch id (``assign``)."""
    num_recycled: int = 0
    """Batch ids released by finished, aborted or preempted requests (``recycle``)."""
    num_moved: int = 0
    """Requests moved between batches by ``rebalance``."""
    max_abs_balance: int = 0
    """Largest |size(batch 0) - size(batch 1)| seen at a sync point."""

    @property
    def num_fallback_steps(self) -> int:
        return self.num_steps - self.num_parallel_steps

    @property
    def coverage(self) -> float:
        """Share of counted steps run in parallel (0.0 before the first step)."""
        return self.num_parallel_steps / self.num_steps if self.num_steps else 0.0

    def record(self, plan: StepPlan, balance: int) -> None:
        self.max_abs_balance = max(self.max_abs_balance, abs(balance))
        if not plan.all_rids:
            return
        self.num_steps += 1
        self.num_parallel_steps += plan.parallel
        self.num_startup_steps += plan.startup
        self.num_undrafted += len(plan.undrafted) if plan.parallel else 0

    def as_dict(self) -> dict[str, float]:
        return {
            "num_steps": self.num_steps,
            "num_parallel_steps": self.num_parallel_steps,
            "num_fallback_steps": self.num_fallback_steps,
            "num_startup_steps": self.num_startup_steps,
            "num_undrafted": self.num_undrafted,
            "num_assigned": self.num_assigned,
            "num_recycled": self.num_recycled,
            "num_moved": self.num_moved,
            "max_abs_balance": self.max_abs_balance,
            "coverage": self.coverage,
        }


class BatchManager:
    """Batch ids, ``balance`` and ``skip_batch`` of §5.1, plus step planning for §5.2.

    Call order per SD step: ``recycle`` the requests that left (finished, aborted, preempted),
    ``assign`` the ones that started running, ``plan_step()``, run the step, then
    ``alternate(plan)`` at the sync point.
    """

    def __init__(self, policy: Policy = "balanced", initial_skip_batch: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if initial_skip_batch not in (0, 1):
            raise ValueError(f"initial_skip_batch must be 0 or 1, got {initial_skip_batch}")
        self.policy: Policy = policy
        self.balance = 0  # size(0) - size(1)
        self.skip_batch = initial_skip_batch
        self.step_id = 0  # sync points passed
        self.stats = CoverageStats()
        self._batch_of: dict[str, int] = {}
        self._members: tuple[dict[str, None], dict[str, None]] = ({}, {})  # ordered sets
        self._has_drafts: set[str] = set()  # drafted in the last step, not yet verified

    # -- membership --------------------------------------------------------------------------

    @property
    def target_batch_id(self) -> int:
        return 1 - self.skip_batch

    def size(self, batch_id: int) -> int:
        return len(self._members[batch_id])

    def batch_of(self, rid: str) -> int | None:
        return self._batch_of.get(rid)

    def draft_batch(self) -> tuple[str, ...]:
        """Requests of the current draft batch (``skip_batch``), in admission order."""
        return tuple(self._members[self.skip_batch])

    def target_batch(self) -> tuple[str, ...]:
        """Requests of the current target batch, in admission order."""
        return tuple(self._members[self.target_batch_id])

    def is_fallback(self) -> bool:
        """One batch is empty while requests run: this step must be standard SD (§5.2)."""
        return bool(self._batch_of) and (self.size(0) == 0 or self.size(1) == 0)

    def running(self) -> tuple[str, ...]:
        """Every request with a batch id."""
        return tuple(self._batch_of)

    def __len__(self) -> int:
        return len(self._batch_of)

    def __contains__(self, rid: object) -> bool:
        return rid in self._batch_of

    # -- assign / recycle (§5.1) -------------------------------------------------------------

    def choose_batch(self) -> int:
        """The batch the next new request would join under this manager's policy."""
        if self.policy == "paper" and self.step_id > 0:
            return self.skip_batch
        if self.balance > 0:
            return 1
        if self.balance < 0:
            return 0
        # Tie. §5.1 picks batch 1; once steps alternate we prefer the draft batch, so the new
        # request is drafted before its first verification (no idle step, Appendix A).
        return 1 if self.policy == "paper" else self.skip_batch

    def assign(self, rid: str) -> int:
        """Give a newly running request a batch id; returns it."""
        if rid in self._batch_of:
            raise ValueError(f"request {rid!r} already has batch {self._batch_of[rid]}")
        batch_id = self.choose_batch()
        self._batch_of[rid] = batch_id
        self._members[batch_id][rid] = None
        self.balance += 1 if batch_id == 0 else -1
        self.stats.num_assigned += 1
        return batch_id

    def recycle(self, rid: str) -> int | None:
        """Release the batch id of a finished, aborted or preempted request (inverse of
        ``assign``). Returns the id it had, or None if it was not running."""
        batch_id = self._batch_of.pop(rid, None)
        if batch_id is None:
            return None
        del self._members[batch_id][rid]
        self._has_drafts.discard(rid)
        self.balance -= 1 if batch_id == 0 else -1
        self.stats.num_recycled += 1
        return batch_id

    def rebalance(self, max_gap: int = 1) -> list[str]:
        """Move requests until the sizes differ by at most ``max_gap``; returns the moved ids.

        Assignment alone cannot undo an imbalance when no new request arrives (a third of one
        batch aborted, Appendix A), and a batch left empty turns every later step into the
        fallback. Only the ``"balanced"`` policy moves requests. The latest-admitted requests
        of the larger batch move; a request's drafts (if any) are for the batch it left, so it
        is drafted again before its next verify when it joins the draft batch, or verified once
        without drafts when it joins the target batch (counted as undrafted).
        """
        if self.policy != "balanced" or max_gap < 1:
            return []
        moved = []
        while abs(self.balance) > max_gap:
            src = 0 if self.balance > 0 else 1
            rid = next(reversed(self._members[src]))
            del self._members[src][rid]
            self._members[1 - src][rid] = None
            self._batch_of[rid] = 1 - src
            self._has_drafts.discard(rid)
            self.balance += -2 if src == 0 else 2
            self.stats.num_moved += 1
            moved.append(rid)
        return moved

    # -- steps (§5.2) ------------------------------------------------------------------------

    def plan_step(self) -> StepPlan:
        """Snapshot of this step's batches; changes no state."""
        target = self.target_batch()
        return StepPlan(
            step_id=self.step_id,
            skip_batch=self.skip_batch,
            draft_rids=self.draft_batch(),
            target_rids=target,
            undrafted=tuple(rid for rid in target if rid not in self._has_drafts),
        )

    def alternate(self, plan: StepPlan) -> None:
        """Sync point: record the finished step ``plan`` and swap the draft and target batch.

        Drafts produced in a parallel step belong to its draft batch's requests still running;
        a fallback step drafts and verifies in one go, so it leaves no drafts behind.
        """
        if plan.step_id != self.step_id:
            raise ValueError(f"plan is for step {plan.step_id}, manager is at {self.step_id}")
        self.stats.record(plan, self.balance)
        if plan.parallel:
            self._has_drafts = {rid for rid in plan.draft_rids if rid in self._batch_of}
        else:
            self._has_drafts = set()
        self.skip_batch = 1 - self.skip_batch
        self.step_id += 1
