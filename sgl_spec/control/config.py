"""The tuning of ``SpeculationController`` (``controller.py``): its ``ControllerConfig``, one
field per choice, and the served defaults every algorithm starts from."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_spec.control.probes import served_budget

# The served controller's tuning (``ControllerConfig`` fields), one for every algorithm. T(k)
# counts as measured after ``calibrate_steps`` served steps; probes last two steps so that the
# second verifies real drafts and updates the acceptance. A probe or a switch back on costs a
# step without drafts, hence rare probes and a margin to switch on. A fresh server's first
# decode steps run several times slower than the rest (lazy initialisation); with them in T(0)
# a k > 0 looked cheap and ran for hundreds of steps, hence ``warmup_steps``. At a large batch,
# where a verify of several tokens per request costs several plain steps, probes of settings
# that could not pay at the batch's plausible acceptance cost that much for nothing (MTP_LORA
# k = 4 at 16 requests: ~7 plain steps each), hence ``plausible_probes``. A host's speed drifts
# by tens of percent within a minute, hence ``paired_times``. Once speculating (a probe
# included), speculation stays on while the best S > 1 (``hold_margin``): turned off by an
# unlucky stretch of drafts, it stays off until a probe, and at one request that cost more
# than the stretch (RESULTS.md, 2026-12-06).
SERVED_TUNING = {"calibrate_steps": 3, "warmup_steps": 16, "probe_steps": 2,
                 "explore_every": 256, "margin": 0.05, "hold_margin": 0.0,
                 "switch_on_margin": 0.10, "paired_times": True,
                 "probe_budget": served_budget(), "plausible_probes": True}  # fmt: skip

# A chain's controller (STANDALONE_FULL, MINEDRAFT, MTP_LORA) on top of ``SERVED_TUNING``: acceptance is a
# property of the requests, so a batch that turned over is probed again; and positions past
# the length in use are never verified, so while speculating the other lengths are probed every
# 32 steps (else one request of poor deep acceptance pins a short chain for good). The first
# step after a switch of length costs more than the next ones, hence ``steady_times``
# (STANDALONE_FULL turns it off: its switch's extra is its draft model's catch-up, which it
# leaves out of the step's time, ``standalone/control.py``).
CHAIN_TUNING = {**SERVED_TUNING, "probe_on_turnover": True, "probe_others_every": 32,
                "steady_times": True}  # fmt: skip

# With ``probe_on_turnover``: steps at k = 0 a turned-over batch runs before its probe (its
# new requests' first tokens, committed plainly whatever the probe finds).
TURNOVER_PROBE_STEPS = 2


@dataclass(frozen=True)
class ControllerConfig:
    """How ``SpeculationController`` weighs and tests its choice of k, one field each."""

    k_max: int = 4
    alpha_prior: float | tuple[float, ...] = 0.7
    """α_j, the probability that draft j is accepted given drafts 1..j-1 were, before any
    observation (one value for every position, or one per position 1..k_max)."""
    ewma_weight: float = 0.05
    """Weight of a new observation in the running α_j."""
    margin: float = 0.02
    """Speculate only when the predicted speedup S > 1 + margin."""
    explore_every: int = 64
    """After that many consecutive steps at k = 0, try the best k > 0 for ``probe_steps``
    steps so that α can recover (0 never explores); while speculating with calibration on,
    k = 0 is probed for one step as often, unless ``refresh_every`` says otherwise."""
    refresh_every: int | None = None
    """While speculating with calibration on, probe k = 0 for one step (``probe_steps`` with
    ``steady_times``; T(0) stays fresh) after that many steps (None: ``explore_every``; 0
    never)."""
    probe_steps: int = 1
    calibrate_steps: int = 0
    """> 0 turns online calibration on: step times count as measured after that many
    observations, k = 0 is measured first in every batch-size bucket, and k without any τ
    estimate (no table) are measured before use."""
    probe_others_every: int = 0
    """While speculating, every that many steps probe the other k > 0 of highest predicted S
    for ``probe_steps`` steps, so that the settings not in use keep fresh estimates (0 never:
    a chain's α per position already carries what one k observes to the others)."""
    time_window: int = 9
    """Step times kept per (bucket, k) for their lower quartile."""
    time_chunk: int = 1
    """Step times averaged into one of those (``StepTimes.chunk``)."""
    paired_times: bool = False
    """With calibration, price settings from a host level that every step moves and offsets
    learnt from steps right after a switch (``StepTimes.paired``, ``levels.py``): on a host whose
    speed drifts, the lower quartiles of two windows sampled at different times divide times
    of different ages. Only where a step's cost is its setting's own: a setting whose cost
    builds up after the switch (a batch it turns over faster) would read as drift."""
    time_batch_changes: bool = False
    """Time a step up to the next one across joins and departures (``StepClock``)."""
    hold_margin: float | None = None
    """While speculating (the step before drafted, a probe's included), stay on while the best
    S > 1 + hold_margin (None: ``margin`` while speculating, a probe's steps not counted).
    Turning off costs more than staying on at a marginal S: nothing measures acceptance while
    off, so an estimate that a few rejected drafts pulled under the margin stays there until a
    probe, tens to hundreds of steps later."""
    switch_on_margin: float = 0.0
    """Extra margin to turn speculation on while it is off: the first step after k = 0 has no
    drafts to verify (it pays T(k) for one token), so a marginal predicted gain would be eaten
    by switching back and forth."""
    probe_on_turnover: bool = False
    """While speculation is off, once the requests that joined the batch since the last probe
    make up half of it, or the batch has shrunk to half its size at that probe, probe again
    within ``TURNOVER_PROBE_STEPS`` steps and reset the backoff: acceptance is a property of
    the requests, and what left drafting off may have left with them (at one request, every
    new request is a new batch); and a smaller batch has more idle compute for drafts."""
    probe_budget: float = 0.0
    """With calibration, the most of serving time probes while off may cost: the wait between
    them is at least their predicted or realised loss over it (``probes.py``; 0: no minimum)."""
    steady_times: bool = False
    """With calibration, time only steps that follow a step at the same k (``StepClock.steady``):
    the first step after a switch costs more, and T(0) while speculating or T(k) while off would
    otherwise come from such steps alone. A probe then runs one step more, and k = 0 is
    refreshed while speculating for ``probe_steps`` steps instead of one."""
    plausible_probes: bool = False
    """While off, probe only settings that could pay at the acceptance a batch of this size
    plausibly has (``SpeculationController.could_pay``): many requests accept near the
    population's mean, so at a large batch where drafting loses at any such acceptance a probe
    only pays its loss; a batch of one request may accept anything, and is probed as before.
    With none plausible the wait doubles; at the longest wait the best setting is probed."""
    warmup_steps: int = 0
    """With calibration, the first steps a server runs are plain (k = 0) and their times are not
    recorded: lazy initialisation makes them several times slower than the rest, and T(0) is
    the reference every τ is measured against. T(0) then counts as measured only after a full
    ``time_window`` of plain steps (they cost nothing extra)."""

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        prior = self.alpha_prior
        if isinstance(prior, (tuple, list)):
            if len(prior) != self.k_max:
                raise ValueError(f"alpha_prior has {len(prior)} values, k_max is {self.k_max}")
            values = prior
        else:
            values = (prior,)
        if not all(0.0 <= a <= 1.0 for a in values):
            raise ValueError(f"alpha_prior values must lie in [0, 1], got {prior}")
        if not 0.0 < self.ewma_weight <= 1.0:
            raise ValueError(f"ewma_weight must lie in (0, 1], got {self.ewma_weight}")
        least = {"margin": 0, "switch_on_margin": 0, "explore_every": 0, "probe_steps": 1,
                 "warmup_steps": 0, "calibrate_steps": 0, "probe_others_every": 0,
                 "refresh_every": 0, "time_chunk": 1, "hold_margin": 0}  # fmt: skip
        for name, low in least.items():
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.time_window < max(self.calibrate_steps, 1):
            raise ValueError(
                f"time_window must be >= max(calibrate_steps, 1), got {self.time_window}"
            )

    def prior(self) -> list[float]:
        prior = self.alpha_prior
        return list(prior) if isinstance(prior, (tuple, list)) else [prior] * self.k_max
