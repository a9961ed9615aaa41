"""Cost-aware serving-time adaptation of the SpecBlock drafter: the decision logic (paper §3.4,
Algorithm 1, App. A.3). Pure Python: no SGLang, no tensors.

Per finished *query* (one served request) the worker reports the verifier-derived signal
``s = sum_{rejected k} (1 - r_k)`` (Eq. 8), the query's acceptance length and a throughput mark
(wall clock, tokens committed so far by the whole server). ``CostAwareBandit.end_query`` then

1. predicts each update's net throughput gain ``s * v_action`` (Eq. 9) and picks skip / head /
   full (skip when both predictions are <= 0);
2. routes the query's training examples into that action's buffer; a saturated buffer *triggers*
   an update (the caller trains ``theta_train`` and later syncs it into ``theta_inf``);
3. ``on_synced`` opens a measurement interval of ``N`` queries; at its close the observed
   throughput change ``Delta_tp`` (interval rate minus the rate of the ``N`` queries before the
   trigger) revises ``v_action <- (1 - alpha) v_action + alpha Delta_tp / s_trig`` (Eq. 10),
   unless ``s_trig < s_min``;
4. the drift guard compares the acceptance length of successive measurement intervals and asks
   for a rollback after three successive drops.

Constants from App. A.3 / §3.4: warm-up 10 queries, cold start of 8 events with epsilon 0.30 ->
0.10, 2 queries blocked after each train event, s_min = 5, alpha = 0.10, lambda = 0.01 (used by
``adapt/update.py``). Our choices, where the paper gives none, are marked "(ours)" on the fields.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T")


class Action(str, Enum):
    SKIP = "skip"
    HEAD = "head"  # lm_head + rank head only (§3.4: output-side mis-mapping)
    FULL = "full"  # every trainable drafter parameter (decoder trunk mismatched)


UPDATE_ACTIONS = (Action.HEAD, Action.FULL)


@dataclass(frozen=True)
class AdaptConfig:
    """Every constant of the adaptation loop; validated once (``--specblock-adapt-options``)."""

    warmup_queries: int = 10  # App. A.3
    cold_start_events: int = 8  # App. A.3
    eps_start: float = 0.30  # App. A.3
    eps_end: float = 0.10  # App. A.3
    cooldown_queries: int = 2  # App. A.3: queries blocked from triggering after a train event
    s_min: float = 5.0  # App. A.3
    alpha: float = 0.10  # §3.4, Eq. (10)
    kl_weight: float = 0.01  # §3.4, lambda
    measure_queries: int = 8  # N (ours): queries per measurement interval
    buffer_queries: int = 4  # (ours): routed queries that saturate a buffer
    rollback_drops: int = 3  # §3.4: successive acceptance-length drops before a rollback
    lr: float = 3e-4  # (ours): AdamW step size of an update
    steps_per_update: int = 2  # (ours): optimizer steps per update (small: CPU hosts share cores)
    window: int = 16  # (ours): block starts per training example
    max_examples_per_query: int = 8  # (ours): newest examples a query contributes
    trainer_nice: int = 10  # (ours): CPU only, niceness added to the training thread (0: off)
    seed: int = 0

    def __post_init__(self) -> None:
        counts = ("warmup_queries", "cold_start_events", "cooldown_queries", "rollback_drops")
        for name in counts:
            if getattr(self, name) < 0:
                raise ValueError(f"adapt option {name} must be >= 0, got {getattr(self, name)}")
        for name in ("measure_queries", "buffer_queries", "steps_per_update", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"adapt option {name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.trainer_nice <= 19:
            raise ValueError(f"adapt option trainer_nice must be in 0..19, got {self.trainer_nice}")
        if self.max_examples_per_query < 1:
            raise ValueError("adapt option max_examples_per_query must be >= 1")
        if not 0.0 <= self.eps_end <= self.eps_start <= 1.0:
            raise ValueError(
                f"adapt options need 0 <= eps_end <= eps_start <= 1, got {self.eps_start},"
                f" {self.eps_end}"
            )
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"adapt option alpha must be in (0, 1], got {self.alpha}")
        if self.s_min < 0 or self.kl_weight < 0 or self.lr <= 0:
            raise ValueError("adapt options s_min, kl_weight must be >= 0 and lr > 0")

    @classmethod
    def parse(cls, text: str | None) -> AdaptConfig:
        """``key=value,key=value`` over the field names, e.g. ``warmup_queries=2,lr=1e-3``."""
        if not text:
            return cls()
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for item in text.split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in kinds:
                raise ValueError(f"unknown adapt option {item!r}; known: {', '.join(kinds)}")
            try:
                values[key] = float(raw) if kinds[key] == "float" else int(raw)
            except ValueError:
                raise ValueError(f"adapt option {key} needs a number, got {raw!r}") from None
        return cls(**values)  # type: ignore[arg-type]


def rejection_signal(rejected_probs: Sequence[float]) -> float:
    """Eq. (8): ``sum (1 - r_k)`` over the rejected positions of a query's verified paths, where
    ``r_k`` is the drafter's probability of the token the target chose there."""
    total = 0.0
    for r in rejected_probs:
        if not 0.0 <= r <= 1.0 + 1e-6:
            raise ValueError(f"a draft probability must be in [0, 1], got {r}")
        total += 1.0 - min(r, 1.0)
    return total


def epsilon(event: int, cfg: AdaptConfig) -> float:
    """App. A.3: exploration rate of cold-start event ``event`` (0-based), linear from
    ``eps_start`` at the first event to ``eps_end`` at the last; 0 after the cold start."""
    if event >= cfg.cold_start_events:
        return 0.0
    if cfg.cold_start_events == 1:
        return cfg.eps_start
    frac = event / (cfg.cold_start_events - 1)
    return cfg.eps_start + (cfg.eps_end - cfg.eps_start) * frac


def ewma(value: float, reward: float, alpha: float) -> float:
    """Eq. (10)."""
    return (1.0 - alpha) * value + alpha * reward


class UpdateBuffer(Generic[T]):
    """Training examples routed to one action; saturated after ``capacity`` routed queries.
    While an update is in flight it keeps filling, holding the newest ``max_examples``."""

    def __init__(self, capacity: int, max_examples: int) -> None:
        self.capacity = capacity
        self.max_examples = max_examples
        self.examples: list[T] = []
        self.num_queries = 0

    def push(self, examples: Sequence[T]) -> None:
        self.examples.extend(examples)
        del self.examples[: -self.max_examples]
        self.num_queries += 1

    @property
    def saturated(self) -> bool:
        return self.num_queries >= self.capacity

    def drain(self) -> list[T]:
        out, self.examples, self.num_queries = self.examples, [], 0
        return out


class DriftGuard:
    """§3.4 fail-safe: acceptance length per serving interval; ``observe`` returns True when it
    has dropped ``drops`` times in a row (the paper's "decreases monotonically across three
    intervals", read as three successive decreases)."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.previous: float | None = None
        self.run = 0

    def observe(self, accept_length: float) -> bool:
        if self.previous is not None and accept_length < self.previous:
            self.run += 1
        else:
            self.run = 0
        self.previous = accept_length
        if self.drops and self.run >= self.drops:
            self.run = 0
            return True
        return False

    def reset(self, accept_length: float | None = None) -> None:
        self.previous, self.run = accept_length, 0


@dataclass
class Mark:
    """Where the server stood when a query ended: wall clock and tokens committed so far."""

    time_s: float
    tokens: int


@dataclass
class Trigger:
    """A fired update: the caller trains ``theta_train`` on ``examples`` for ``action``."""

    action: Action
    signal: float  # s_trig
    examples: list = field(default_factory=list)


@dataclass
class QueryDecision:
    action: Action
    predicted: dict[Action, float]
    trigger: Trigger | None = None
    rollback: bool = False  # revert theta_inf to the last good weights
    good: bool = False  # an interval closed without a drop: theta_inf's weights are good
    explored: bool = False


@dataclass
class _Interval:
    """The measurement interval of one synced update."""

    trigger: Trigger
    reference: float | None  # tokens/s over the N queries before the trigger
    opened: Mark
    queries: int = 0
    tau_sum: float = 0.0


def rate(first: Mark, last: Mark) -> float | None:
    """Tokens per second between two marks (None without elapsed time)."""
    elapsed = last.time_s - first.time_s
    return None if elapsed <= 0 else (last.tokens - first.tokens) / elapsed


class CostAwareBandit(Generic[T]):
    """Algorithm 1's control flow. The phases of one update: *triggered* (training runs, no new
    trigger), *measuring* (after ``on_synced``, ``N`` queries; no new trigger -- two updates'
    effects would mix in one ``Delta_tp``), then idle after the cooldown.

    Cold start (first ``cold_start_events`` updates): an action without any measured reward yet
    is predicted optimistically (so both get seeded), and with probability ``epsilon`` a random
    update action is taken; a query with ``s = 0`` (nothing rejected) is always skipped.
    A rollback resets ``v_head``, ``v_full`` and re-enters the cold start (our choice: with both
    values at 0, Eq. 9 alone would skip forever).
    """

    def __init__(self, cfg: AdaptConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.values = {a: 0.0 for a in UPDATE_ACTIONS}
        self.seeded = {a: False for a in UPDATE_ACTIONS}
        self.buffers: dict[Action, UpdateBuffer[T]] = {
            a: UpdateBuffer(cfg.buffer_queries, cfg.buffer_queries * cfg.max_examples_per_query)
            for a in UPDATE_ACTIONS
        }
        self.guard = DriftGuard(cfg.rollback_drops)
        self.marks: deque[Mark] = deque(maxlen=cfg.measure_queries + 1)
        self.num_queries = 0
        self.num_events = 0  # updates triggered since the start or the last rollback
        self.counts = {a: 0 for a in Action}
        self.num_updates = 0
        self.num_rollbacks = 0
        self.last_signal = 0.0
        self.baseline_tp: float | None = None  # rate over the warm-up
        self._start: Mark | None = None
        self._pending: tuple[Trigger, float | None] | None = None  # trigger, reference rate
        self._interval: _Interval | None = None
        self._cooldown = 0
        self._warmup_tau = 0.0

    # ---- per query ---------------------------------------------------------------------------

    def choose(self, signal: float) -> tuple[Action, dict[Action, float], bool]:
        """Eq. (9) with the cold-start rules; returns (action, predicted gains, explored)."""
        predicted = {a: signal * self.values[a] for a in UPDATE_ACTIONS}
        if signal <= 0:
            return Action.SKIP, predicted, False
        if self.num_events < self.cfg.cold_start_events:
            if self.rng.random() < epsilon(self.num_events, self.cfg):
                return self.rng.choice(UPDATE_ACTIONS), predicted, True
            optimistic = {
                a: (float("inf") if not self.seeded[a] else g) for a, g in predicted.items()
            }
            best = max(UPDATE_ACTIONS, key=lambda a: optimistic[a])  # ties: HEAD, the cheaper
            return (best if optimistic[best] > 0 else Action.SKIP), predicted, False
        best = max(UPDATE_ACTIONS, key=lambda a: predicted[a])
        return (best if predicted[best] > 0 else Action.SKIP), predicted, False

    def end_query(
        self, signal: float, accept_length: float, mark: Mark, examples: Sequence[T] = ()
    ) -> QueryDecision:
        """Algorithm 1 for one finished query."""
        if signal < 0 or accept_length < 0:
            raise ValueError(f"signal and accept_length must be >= 0: {signal}, {accept_length}")
        self.num_queries += 1
        self.last_signal = signal
        if self._start is None:
            self._start = mark
        self.marks.append(mark)
        closed = self._advance_interval(accept_length, mark)
        rollback, good = closed is True, closed is False
        if self.num_queries <= self.cfg.warmup_queries:
            self._warmup_tau += accept_length
            if self.num_queries == self.cfg.warmup_queries:
                self.baseline_tp = rate(self._start, mark)
                self.guard.reset(self._warmup_tau / self.num_queries)
            self.counts[Action.SKIP] += 1
            return QueryDecision(Action.SKIP, {}, rollback=rollback, good=good)
        blocked = self._cooldown > 0
        self._cooldown = max(self._cooldown - 1, 0)
        action, predicted, explored = self.choose(signal)
        self.counts[action] += 1
        decision = QueryDecision(action, predicted, rollback=rollback, good=good, explored=explored)
        if action is Action.SKIP:
            return decision
        buffer = self.buffers[action]
        buffer.push(examples)
        idle = self._pending is None and self._interval is None
        if not blocked and buffer.saturated and idle:
            reference = rate(self.marks[0], self.marks[-1]) if len(self.marks) > 1 else None
            trigger = Trigger(action, signal, buffer.drain())
            self._pending = (trigger, reference)
            self.num_events += 1
            self._cooldown = self.cfg.cooldown_queries
            decision.trigger = trigger
        return decision

    # ---- update lifecycle --------------------------------------------------------------------

    def on_synced(self, mark: Mark) -> None:
        """``theta_inf`` now holds the pending update: open its measurement interval."""
        if self._pending is None:
            raise RuntimeError("on_synced without a pending update")
        trigger, reference = self._pending
        self._pending = None
        self.num_updates += 1
        self._interval = _Interval(trigger, reference, mark)

    def on_failed(self) -> None:
        """The pending update did not train (an error): drop it without a reward."""
        self._pending = None

    def _advance_interval(self, accept_length: float, mark: Mark) -> bool | None:
        """None while no interval closes; at a close True for a rollback, False otherwise."""
        interval = self._interval
        if interval is None:
            return None
        interval.queries += 1
        interval.tau_sum += accept_length
        if interval.queries < self.cfg.measure_queries:
            return None
        self._interval = None
        observed, reference = rate(interval.opened, mark), interval.reference
        trigger = interval.trigger
        if observed is not None and reference is not None and trigger.signal >= self.cfg.s_min:
            reward = (observed - reference) / trigger.signal
            self.values[trigger.action] = ewma(self.values[trigger.action], reward, self.cfg.alpha)
            self.seeded[trigger.action] = True
        if self.guard.observe(interval.tau_sum / interval.queries):
            self._roll_back()
            return True
        return False if self.guard.run == 0 else None

    def _roll_back(self) -> None:
        self.num_rollbacks += 1
        self.values = {a: 0.0 for a in UPDATE_ACTIONS}
        self.seeded = {a: False for a in UPDATE_ACTIONS}
        self.num_events = 0
        for buffer in self.buffers.values():
            buffer.drain()

    @property
    def measuring(self) -> bool:
        return self._interval is not None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def summary(self) -> str:
        counts = "/".join(str(self.counts[a]) for a in Action)
        return (
            f"adapt_skip/head/full={counts} adapt_last_s={self.last_signal:.2f}"
            f" adapt_v_head={self.values[Action.HEAD]:.4g}"
            f" adapt_v_full={self.values[Action.FULL]:.4g}"
            f" adapt_updates={self.num_updates} adapt_rollbacks={self.num_rollbacks}"
        )
