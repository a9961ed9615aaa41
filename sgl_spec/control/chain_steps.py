"""A chain's length chosen per step, for the algorithms that draft one chain per request from a
draft model (STANDALONE_FULL's ``--standalone-steps``, MINEDRAFT's ``--minedraft-steps``).

``ChainSteps`` names each decode step's number of drafts, 0 (a plain decode step) to the
launch's chain length: 'auto' asks the speculation controller (measured step times per batch
size and length, running acceptance per position), 'fixed' keeps the full chain, 'cycle' takes
every length in turn (every switch exercised: for tests), 'off' keeps 0 (the floor 'auto' falls
back to: for measuring it).
"""

from __future__ import annotations

from typing import Any

from sgl_spec.control.config import CHAIN_TUNING, ControllerConfig
from sgl_spec.control.controller import SpeculationController
from sgl_spec.control.cost_model import DrafterCost
from sgl_spec.control.guard import served_controller
from sgl_spec.flags import CHAIN_STEPS_MODES

# A draft model's chain: probing while off every 64 steps, not 256 (``SERVED_TUNING``): a
# probe pays the draft's catch-up on the tokens committed meanwhile, not a step without drafts
# as MTP_LORA's does. At high concurrency a full chain turns the batch over every step or two
# and the step after a join is the draft model's slow one (it takes the new prompt first), so
# steps are timed across batch changes, 4 to a sample (``step_times.py``), each setting by its
# window's lower quartile (the cost a chain brings builds up after a switch, as the batch turns
# over faster: no ``paired_times``); and the old on/off margins, no ``hold_margin`` (its one
# sweep with STANDALONE_FULL did not separate it from a server twice as slow, RESULTS.md).
DRAFT_CHAIN_TUNING = {
    **CHAIN_TUNING,
    "explore_every": 64,
    "time_chunk": 4,
    "time_batch_changes": True,
    "paired_times": False,
    "hold_margin": None,
}


def steps_controller(max_steps: int, alpha: float = 0.7, **tuning: Any) -> SpeculationController:
    """Chain lengths 0..``max_steps`` priced by served step times (no γ table, the draft's
    cost folded into the measured times); ``tuning`` overrides ``DRAFT_CHAIN_TUNING``."""
    tuning = {**DRAFT_CHAIN_TUNING, **tuning}
    config = ControllerConfig(k_max=max_steps, alpha_prior=alpha, **tuning)
    return SpeculationController(None, DrafterCost(0.0), config)


def chain_widths(mode: str, max_steps: int) -> tuple[list[int], bool]:
    """The verify widths (drafts + 1) the steps of a chain at ``mode`` may run, and whether a
    step may run without drafts (a plain decode)."""
    if mode == "fixed":
        return [max_steps + 1], False
    if mode == "off":
        return [], True
    return list(range(2, max_steps + 2)), True  # auto, cycle: 1 .. max_steps drafts, or none


class ChainSteps:
    """The number of drafts of each decode step (module docstring); ``choose`` before the
    step, ``observe`` the acceptance of the requests that were offered that many drafts;
    ``tuning`` overrides ``DRAFT_CHAIN_TUNING`` of the ``auto`` controller."""

    def __init__(self, mode: str, max_steps: int, flag: str, **tuning: Any) -> None:
        if mode not in CHAIN_STEPS_MODES:
            raise ValueError(f"{flag} must be one of {', '.join(CHAIN_STEPS_MODES)}; got {mode!r}")
        if max_steps < 1:
            raise ValueError(f"{flag} {mode} needs --speculative-num-steps >= 1")
        self.mode = mode
        self.max_steps = max_steps
        self.controller: Any = served_controller(
            steps_controller(max_steps, **tuning) if mode == "auto" else None
        )
        self.steps = 0 if mode == "off" else max_steps  # the length chosen last
        self.lam = 1.0  # the controller's predicted tokens per request for it
        self._cycle = 0

    def choose(self, batch_size: int, ctx_len: int) -> int:
        """The number of drafts of the next decode step."""
        if self.mode == "cycle":
            self.steps = self._cycle % (self.max_steps + 1)
            self._cycle += 1
        elif self.controller is not None:
            decision = self.controller.decide(batch_size, ctx_len)
            self.steps, self.lam = decision.k, decision.lam
        return self.steps

    def steps_to_probe(self) -> int:
        """Plain steps before the next drafted one is due: 'auto' asks its controller (a
        scheduled probe; 0 while drafting), 'cycle' drafts within 3 steps, 'off' never."""
        if self.controller is not None:
            return self.controller.steps_to_probe()
        return 0 if self.mode != "off" else 1 << 30

    def observe(self, num_accepted: list[int]) -> None:
        """Drafts accepted per request in the step that ran at ``self.steps`` (only requests
        offered that many drafts say anything about the positions)."""
        if self.controller is not None and self.steps > 0 and num_accepted:
            self.controller.observe(self.steps, num_accepted)
