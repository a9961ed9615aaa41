"""The served controller over node budgets of one verified tree per request (SPECBLOCK's
``--specblock-budget auto``): ``SpeculationController`` with ``BudgetAcceptance`` and
``BudgetCost``, calibrated online from served step times."""

from __future__ import annotations

from collections.abc import Sequence

from sgl_spec.control.acceptance import BudgetAcceptance
from sgl_spec.control.config import SERVED_TUNING, ControllerConfig
from sgl_spec.control.controller import SpeculationController
from sgl_spec.control.cost_model import BudgetCost
from sgl_spec.control.probes import served_budget

# The share of serving time probes while off may cost (``probes.py``). A probe's first step
# reads, through the drafter, every token the batch committed while off (left out of its step
# time, counted in its price): at 16 requests that is tens of plain steps' worth, and probes
# every 16-64 steps left the default under its own floor (RESULTS.md, 2026-12-02).
PROBE_BUDGET = 0.03
# A step's weight in a budget's running acceptance per request it observed, up to the EWMA
# weight of the served tuning (0.25): one request's accepted drafts at 8 nodes vary by 1.5 from
# step to step (random-token prompts, RESULTS.md), so at one request a weight of 0.25 turned
# drafting off on a few unlucky steps where it paid 1.7x.
REQUEST_WEIGHT = 0.1


def budget_controller(
    budgets: Sequence[int], max_drafts: Sequence[int], alpha: float = 0.7
) -> SpeculationController:
    """The served controller over draft budgets (``budgets[0]`` = 1: the root alone, no
    drafts; ``max_drafts[k]``: the most drafts a request can accept under ``budgets[k]``),
    calibrated online from served step times. Before a budget is observed it is expected to
    accept a chain's worth at acceptance ``alpha`` per position, up to its ``max_drafts``.
    Each budget is observed only while it runs, so the others are probed now and then."""
    prior = [sum(alpha**i for i in range(1, d + 1)) for d in max_drafts]
    # A budget's probe drafts in the step it runs (no step without drafts, as MTP_LORA's first
    # step after k = 0 has), so probing while off costs little: every 16 steps, not 256; a
    # plain step while speculating still costs one (T(0) refreshed every 256 steps).
    # Acceptance moves with each request (a tree of 8 nodes accepts 1 to 4 tokens a step on
    # one prompt or another): a budget's estimate follows within a few steps of a batch, and
    # within ten or so at one request (``REQUEST_WEIGHT``).
    tuning = {**SERVED_TUNING, "explore_every": 16, "refresh_every": 256}
    tuning.update(probe_others_every=32, ewma_weight=0.25, probe_on_turnover=True)
    tuning.update(probe_budget=served_budget(PROBE_BUDGET))
    config = ControllerConfig(k_max=len(budgets) - 1, alpha_prior=alpha, **tuning)
    acceptance = BudgetAcceptance(max_drafts, prior, config.ewma_weight, REQUEST_WEIGHT)
    return SpeculationController(None, BudgetCost(tuple(budgets)), config, acceptance)
