"""Choose how much to speculate per step from measured step times and live acceptance.

Shared by the algorithms (``sgl_spec/control``): each indexes its settings by k = 0..k_max,
ordered by cost, k = 0 a step without drafts -- MTP_LORA's k is its number of mask drafts,
SPECBLOCK's its tree node budget (``acceptance.BudgetAcceptance``). The rest of this docstring
speaks of k drafts, the case the seed paper treats.

Seed paper §3.1: a step that proposes γ drafts has the speedup S of equation 1, from λ, the
*acceptance length* (accepted drafts plus the bonus token), τ(γ+1) = T(1)/T(γ+1) and the
drafter's per-draft cost δ (``cost_model.py``, with the measured τ table ``GammaTable``).
Speculation pays only while S > 1, and on large batches τ falls fast with γ (§4.1), so the best
number of drafts k depends on batch size, context length and how well drafts are currently
accepted. This module holds the online controller, pure (no SGLang): ``SpeculationController``
keeps per-position acceptance estimates and returns the k with the highest predicted S, or 0
(speculation off); the served step times of online calibration are ``step_times.py``.

Online calibration (beyond the paper): an offline τ table times a bare forward, while a served
step also pays the method's own work. With ``calibrate_steps > 0`` the controller keeps
``StepTimes`` (served step times per batch-size bucket and k); once T(k) and T(0) are measured
in a bucket, S = λ(k)·T(0)/T(k) replaces equation 1 there. An unmeasured k is bounded by the
times of the smaller k measured so far, or of the same k at a smaller batch (τ does not rise
with batch size), and by how the settings' extra costs compared at a smaller batch (they do not
flatten as the batch grows): it is probed only if that optimistic bound could beat k = 0.
Periodic probes keep every estimate fresh: of k = 0 while speculating, of k > 0 while off, at
intervals that double, up to ``MAX_EXPLORE_BACKOFF`` times, while probes keep confirming it,
and that are long enough for the probes to cost at most ``probe_budget`` of serving time
(``probes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sgl_spec.control.acceptance import AcceptanceModel, ChainAcceptance
from sgl_spec.control.bounds import cheaper_first, plausible_length, tau_bound
from sgl_spec.control.config import TURNOVER_PROBE_STEPS, ControllerConfig
from sgl_spec.control.cost_model import GammaTable, StepCost, predicted_speedup
from sgl_spec.control.observing import AcceptanceObserver
from sgl_spec.control.probes import UNPRICED_NEW_BATCH, ProbePrices
from sgl_spec.control.step_times import StepTimes

# While probes keep confirming that speculation does not pay, the wait between them doubles up
# to this multiple of ``explore_every``; a step that speculates on merit resets it.
MAX_EXPLORE_BACKOFF = 8
# With ``plausible_probes``, while no setting could pay at a plausible acceptance, the wait
# doubles up to this many steps instead (the times the decision rests on are checked again then).
IMPLAUSIBLE_WAIT = 1024


@dataclass(frozen=True)
class Decision:
    """What ``SpeculationController`` chose, with the numbers behind it for logging.

    ``gamma``: tokens per request of the verify forward; ``tau`` = τ(gamma); ``lam``: predicted
    acceptance length; ``explore``: a k tried only to refresh an estimate. ``source``: where τ
    came from: "measured" (served step times, τ = T(0)/T(k)), "table" (the γ table), "bound"
    (T(k) not measured yet: an upper bound from the times measured here and at smaller batch
    sizes, ``bounds.tau_bound``), "prior" (nothing known, τ = 1), "calibrate" (k = 0 for T(0))."""

    k: int
    predicted_speedup: float
    gamma: int
    tau: float
    lam: float
    explore: bool = False
    source: str = "table"


class SpeculationController(AcceptanceObserver):
    """argmax_k S(k) = λ(k)·τ(γ(k)) / (1 + k·δ·τ(γ(k))) over the settings k in [0, k_max],
    ordered by cost (k = 0: no speculation), with λ(k) from an acceptance model
    (``acceptance.py``): by default a chain's, λ(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j from running
    per-position estimates, α_j estimated conditionally (accepted among the requests that
    reached draft j) so that observations made at one k stay valid for predicting another.
    τ comes from the table, or, with online calibration, from measured step times.

    ``predict`` and ``best`` are pure; ``decide``/``choose_k`` add calibration and probes,
    ``observe`` updates α and ``observe_step`` the step times -- the only places that change
    state. ``table`` may be None only with online calibration on.
    """

    def __init__(
        self,
        table: GammaTable | None,
        cost: StepCost,
        config: ControllerConfig | None = None,
        acceptance: AcceptanceModel | None = None,
    ) -> None:
        self.table = table
        self.cost = cost
        self.config = config or ControllerConfig()
        if table is None and not self.config.calibrate_steps:
            raise ValueError("a controller without a γ table needs calibrate_steps > 0")
        largest = cost.tokens_per_step(self.config.k_max)
        if table is not None and largest > table.max_gamma:
            raise ValueError(
                f"k_max={self.config.k_max} needs τ at γ={largest} tokens per request, but the "
                f"table stops at γ={table.max_gamma}; measure larger --gammas or lower k_max"
            )
        # λ(k): per-position α of a chain unless the algorithm's settings need another model
        self.acceptance = acceptance or ChainAcceptance(
            self.config.prior(), self.config.ewma_weight
        )
        if self.acceptance.most_accepted(0) != 0:
            raise ValueError("setting k = 0 of an acceptance model must have no drafts")
        min_samples = max(self.config.calibrate_steps, 1)
        self.times = StepTimes(
            self.config.time_window, min_samples, self.config.time_chunk, self.config.paired_times
        )
        self.num_steps_off = 0  # consecutive steps at k = 0
        self.num_steps_seen = 0  # steps reported to observe_step, warm-up included
        self.num_steps_on = 0  # consecutive steps at k > 0
        self._last_k = 0  # the setting of the last decision
        self._backoff = 1  # explore_every multiplier while speculation stays off
        self._implausible = False  # the last probe due found no setting that could pay
        self._joined = 0  # requests that joined since the last probe (probe_on_turnover)
        self._probed_batch_size = 0  # at the last probe
        self._probe: tuple[int, int, int] | None = None  # (k, steps left, the k it is for)
        self.prices = ProbePrices(self.config.probe_budget, self.config.probe_steps)  # validates
        self._since_probe = 0  # decisions since the last probe started
        self._priced_wait = 0  # the least wait after it, as last priced

    @property
    def calibrating(self) -> bool:
        return self.config.calibrate_steps > 0

    @property
    def alphas(self) -> list[float]:
        """The per-position α of the chain model (``ChainAcceptance``)."""
        return self.acceptance.alphas  # type: ignore[attr-defined]

    def acceptance_length(self, k: int) -> float:
        """λ(k): 1 (the bonus token) + expected number of accepted drafts."""
        return self.acceptance.length(k)

    def predict(self, k: int, batch_size: int, ctx_len: int) -> Decision:
        """Predicted S for exactly ``k`` drafts (k = 0: no speculation, S = 1 by definition)."""
        gamma = self.cost.tokens_per_step(k)
        lam = self.acceptance_length(k)
        t0 = self.times.get(batch_size, 0) if self.calibrating else None
        tk = self.times.get(batch_size, k) if self.calibrating else None
        if t0 is not None and tk is not None:
            tau = t0 / tk
            return Decision(k, lam * tau if k else 1.0, gamma, tau, lam, source="measured")
        if self.table is None:
            if t0 is None or k == 0:
                return Decision(k, lam if k else 1.0, gamma, 1.0, lam, source="prior")
            tau = tau_bound(self.times, self.cost, batch_size, k, t0)
            return Decision(k, lam * tau, gamma, tau, lam, source="bound")
        tau = self.table.tau(batch_size, ctx_len, gamma)
        if k == 0:
            return Decision(0, 1.0, gamma, tau, lam)
        speedup = predicted_speedup(lam, tau, k, self.cost.delta)
        return Decision(k, speedup, gamma, tau, lam)

    def best(
        self, batch_size: int, ctx_len: int, min_k: int = 0, extra_margin: float = 0.0
    ) -> Decision:
        """The k >= ``min_k`` of highest predicted S; with ``min_k`` 0, k = 0 unless some
        k beats 1 + margin + ``extra_margin``."""
        candidates = [
            self.predict(k, batch_size, ctx_len)
            for k in range(max(min_k, 1), self.config.k_max + 1)
        ]
        top = max(candidates, key=lambda d: d.predicted_speedup)
        if min_k == 0 and top.predicted_speedup <= 1.0 + self.config.margin + extra_margin:
            return self.predict(0, batch_size, ctx_len)
        return top

    def decide(self, batch_size: int, ctx_len: int) -> Decision:
        decision = self._decide(batch_size, ctx_len)
        self._last_k = decision.k
        return decision

    def _decide(self, batch_size: int, ctx_len: int) -> Decision:
        self._since_probe += 1
        if self._probe is not None:
            k, left, target = self._probe
            if self._ruled_out(k, target, batch_size, ctx_len):
                self._probe = None  # what it measured so far: the setting cannot pay here
            else:
                self._probe = (k, left - 1, target) if left > 1 else None
                return replace(self.predict(k, batch_size, ctx_len), explore=True)
        if self.calibrating:
            if self.num_steps_seen < self.config.warmup_steps:
                return replace(self.predict(0, batch_size, ctx_len), source="calibrate")
            needed = self._calibration_step(batch_size, ctx_len)
            if needed is not None:
                return needed
        decision = self.best(batch_size, ctx_len, extra_margin=self._extra_margin())
        if decision.k > 0 and decision.source == "bound" and not self.num_steps_on:
            # a bound is no measurement to hold on to: turning on from it pays the switch margin
            extra = self.config.switch_on_margin
            decision = self.best(batch_size, ctx_len, extra_margin=extra)
        every = self.config.explore_every
        if decision.k > 0:
            self.num_steps_off = 0
            self.num_steps_on += 1
            self._backoff, self._implausible = 1, False
            refresh = every if self.config.refresh_every is None else self.config.refresh_every
            if self.calibrating and refresh and self.num_steps_on % (refresh + 1) == 0:
                # refresh T(0) with plain steps; speculation stays on
                if self.config.steady_times and self.config.probe_steps > 1:
                    self._probe = (0, self.config.probe_steps - 1, 0)
                return replace(self.predict(0, batch_size, ctx_len), explore=True)
            others = self.config.probe_others_every
            if others and self.num_steps_on % others == 0:
                rivals = [
                    self.predict(j, batch_size, ctx_len)
                    for j in range(1, self.config.k_max + 1)
                    if j != decision.k
                ]
                if rivals:
                    best_rival = max(rivals, key=lambda d: d.predicted_speedup)
                    return self._start_probe(best_rival, batch_size)
            return decision
        self.num_steps_on = 0
        if every and self.num_steps_off >= every * self._backoff:
            probe = self._probe_while_off(batch_size, ctx_len)
            if probe is not None:
                return probe
        self.num_steps_off += 1
        return decision

    def _extra_margin(self) -> float:
        """Over ``margin``, what the best S must beat: with ``hold_margin``, hold - margin while
        the step before drafted (a probe's too: it paid the switch); without, 0 while
        speculating; else ``switch_on_margin``."""
        hold = self.config.hold_margin
        if hold is None:
            return 0.0 if self.num_steps_on else self.config.switch_on_margin
        if self.num_steps_on or self._last_k > 0:
            return hold - self.config.margin
        return self.config.switch_on_margin

    def _probe_while_off(self, batch_size: int, ctx_len: int) -> Decision | None:
        """The probe due while off, or None: not yet paid for (``probe_budget``), or, with
        ``plausible_probes``, no setting could pay at a plausible acceptance (the wait doubles
        up to ``IMPLAUSIBLE_WAIT`` steps; then the best setting is probed all the same)."""
        candidates = [self.predict(k, batch_size, ctx_len) for k in range(1, self.config.k_max + 1)]
        if self.config.plausible_probes:
            plausible = [d for d in candidates if self.could_pay(d, batch_size)]
            self._implausible = not plausible
            longest = max(MAX_EXPLORE_BACKOFF, IMPLAUSIBLE_WAIT // self.config.explore_every)
            if not plausible and self._backoff < longest:
                self.num_steps_off = 0
                self._backoff = min(2 * self._backoff, longest)
                return None
            candidates = plausible or candidates
        explore = max(candidates, key=lambda d: d.predicted_speedup)
        target = explore.k
        if explore.source == "bound":
            explore = self._measure_first(explore, batch_size, ctx_len)
        # a setting not measured here: priced from its bound, probed until measured (a probe
        # that leaves speculation off doubles the wait for the next one, below)
        steps = max(self._steps_to_measure(batch_size, explore.k), self.config.probe_steps)
        known = explore.source in ("measured", "bound")
        self._priced_wait = self.prices.wait(batch_size, explore.tau, explore.lam, known, steps)
        if self._since_probe < self._priced_wait:
            return None
        self.num_steps_off = 0
        if not self._implausible:
            self._backoff = min(2 * self._backoff, MAX_EXPLORE_BACKOFF)
        self.prices.opened(explore.k, steps)
        return self._start_probe(explore, batch_size, steps, target)

    def plausible_length(self, k: int, batch_size: int) -> float:
        """``bounds.plausible_length`` of this controller's acceptance model."""
        return plausible_length(self.acceptance, k, batch_size)

    def could_pay(self, decision: Decision, batch_size: int) -> bool:
        """Whether ``decision``'s setting beats 1 + margin at ``plausible_length``: else a probe
        could only confirm that it loses. A τ from the γ table or the prior always could."""
        if decision.k == 0 or decision.source not in ("measured", "bound"):
            return True
        lam = self.plausible_length(decision.k, batch_size)
        return decision.tau * lam > 1.0 + self.config.margin

    def _ruled_out(self, k: int, target: int, batch_size: int, ctx_len: int) -> bool:
        """With ``plausible_probes``, whether a probe of k for setting ``target`` > 0 ends
        early: its first samples at this batch size (``StepTimes.provisional``) show that
        ``target`` cannot pay at the batch's plausible acceptance. Nothing else ends one: a
        step or two of acceptance says little, and a probe carried into a larger batch
        measures that batch's times (RESULTS.md, 2026-12-04)."""
        if target == 0 or not self.config.plausible_probes:
            return False
        if self.times.provisional(batch_size, k) is None:
            return False
        return not self.could_pay(self.predict(target, batch_size, ctx_len), batch_size)

    def _calibration_step(self, batch_size: int, ctx_len: int) -> Decision | None:
        """k = 0 until T(0) is measured in this bucket; then, without a table, each k > 0 in
        increasing order (a probe long enough to be measured) unless its bound already rules it
        out -- or first a cheaper one whose time would tighten that bound
        (``bounds.cheaper_first``)."""
        if self._measuring_t0(batch_size):
            return replace(self.predict(0, batch_size, ctx_len), source="calibrate")
        if self.table is None:
            for k in range(1, self.config.k_max + 1):
                if self.times.get(batch_size, k) is not None:
                    continue
                bound = self.predict(k, batch_size, ctx_len)
                if bound.predicted_speedup <= 1.0 + self.config.margin:
                    continue  # cannot pay even at its bound (``bounds.tau_bound``)
                if self.config.plausible_probes and not self.could_pay(bound, batch_size):
                    continue  # nor at any acceptance this batch plausibly has
                probe = self._measure_first(bound, batch_size, ctx_len)
                steps = self._steps_to_measure(batch_size, probe.k)
                return self._start_probe(probe, batch_size, steps, k)
        return None

    def _measuring_t0(self, batch_size: int) -> bool:
        """Whether this bucket's steps run plain to measure T(0) (a full window after warm-up)."""
        return self.times.get(batch_size, 0) is None or bool(
            self.config.warmup_steps and self.times.count(batch_size, 0) < self.times.window
        )

    def _measure_first(self, decision: Decision, batch_size: int, ctx_len: int) -> Decision:
        """``decision``, or the cheaper setting whose time would bound its one
        (``bounds.cheaper_first``), to probe first."""
        first = cheaper_first(self.times, batch_size, decision.k)
        return decision if first == decision.k else self.predict(first, batch_size, ctx_len)

    def _steps_to_measure(self, batch_size: int, k: int) -> int:
        """Steps of a probe of k that measure T(k): its first is not timed with steady times."""
        steps = self.times.steps_to_measure(batch_size, k)
        return steps + 1 if steps and self.config.steady_times else steps

    def batch_changed(self, joined: int, batch_size: int) -> None:
        """``joined`` of ``batch_size`` requests are new: acceptance renewed, turnover probed."""
        if not self.config.probe_on_turnover:
            return
        self.acceptance.renew(joined / batch_size if batch_size > 0 else 0.0)
        self._joined += joined
        every = self.config.explore_every
        turned_over = 2 * self._joined >= batch_size
        shrunk = 2 * batch_size <= self._probed_batch_size
        if every and self.num_steps_on == 0 and (turned_over or shrunk):
            self._joined, self._probed_batch_size = 0, batch_size
            if shrunk or not self._implausible:  # else the wait keeps doubling: nothing could
                self._backoff = 1  # pay at this batch's plausible acceptance (``could_pay``)
            self.num_steps_off = max(self.num_steps_off, every - TURNOVER_PROBE_STEPS)
            if batch_size <= UNPRICED_NEW_BATCH and joined >= batch_size:  # at any price
                self._since_probe = 1 << 30

    def _start_probe(
        self,
        decision: Decision,
        batch_size: int,
        steps: int | None = None,
        target: int | None = None,
    ) -> Decision:
        """Run ``decision``'s k for ``steps`` steps (at least ``probe_steps``), to measure
        setting ``target`` (default: that k; a cheaper one may be measured first)."""
        self._joined, self._probed_batch_size = 0, batch_size
        self._since_probe = 0
        if self.num_steps_on == 0:  # a probe while off re-measures
            self.acceptance.reopen()
        steps = max(steps or 0, self.config.probe_steps)
        if steps > 1:
            self._probe = (decision.k, steps - 1, decision.k if target is None else target)
        return replace(decision, explore=True)

    def choose_k(self, batch_size: int, ctx_len: int) -> int:
        return self.decide(batch_size, ctx_len).k

    def expects_drafts(self, batch_size: int, ctx_len: int, measured: bool = False) -> bool:
        """Whether the next steps at this batch would draft (pure; probes not foreseen): not
        while warming up or measuring T(0) of its bucket, else where the best setting drafts;
        with ``measured``, only where that setting's step time was measured at this batch
        (not a bound from other batches, nor the prior)."""
        warming = self.num_steps_seen < self.config.warmup_steps
        if self.calibrating and (warming or self._measuring_t0(batch_size)):
            return False
        best = self.best(batch_size, ctx_len)
        return best.k > 0 and not (measured and best.source in ("bound", "prior"))

    def steps_to_probe(self) -> int:
        """Plain steps before the next scheduled probe (0 while probing or speculating), for
        work a probe needs done ahead; calibration probes are not foreseen."""
        if self._probe is not None or self.num_steps_on:
            return 0
        every = self.config.explore_every
        if not every:
            return 1 << 30
        due = every * self._backoff - self.num_steps_off
        return max(0, due, self._priced_wait - self._since_probe)

    def observe_step(self, k: int, batch_size: int, seconds: float, steady: bool = True) -> None:
        """A served step with ``k`` drafts for ``batch_size`` requests took ``seconds``;
        ``steady``: the step before it ran the same k (``steady_times``)."""
        self.num_steps_seen += 1
        if self.calibrating and self.num_steps_seen > self.config.warmup_steps:
            if steady or not self.config.steady_times:
                self.times.update(batch_size, k, seconds)
            if self.prices.budget:  # else nothing is priced: no per-step lookups
                t0, lam = self.times.get(batch_size, 0), self.acceptance_length(k)
                self.prices.observed(k, batch_size, seconds, t0, lam)
