"""STANDALONE_FULL's settings in ``sgl_spec.config.SpecConfig``: it takes SGLang's STANDALONE
flags for its draft shape; the launcher records that the launch asked for it, and
``--standalone-steps`` says who chooses each step's chain length."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_spec.flags import CHAIN_STEPS_MODES, flag


@dataclass(frozen=True)
class StandaloneFlags:
    standalone_full_context: bool = flag(
        False,
        "--speculative-algorithm STANDALONE_FULL",
        "STANDALONE_FULL: set by the launcher when the launch asks for it; SGLang serves"
        " STANDALONE with our draft worker in every process.",
        kind="internal",
    )
    standalone_steps: str | None = flag(
        None,
        "--standalone-steps",
        "STANDALONE_FULL (chain, --speculative-eagle-topk 1): 'auto' lets the speculation"
        " controller (sgl_spec/control) choose each step's chain length among 0 (no drafts: a"
        " plain decode step, the draft model's forwards deferred and caught up later)"
        " .. --speculative-num-steps, from the measured step time and the running acceptance"
        " per position at the current batch size, switched through SGLang's adaptive runtime"
        " states; 'fixed' drafts --speculative-num-steps tokens every step; 'cycle' takes 0 .."
        " --speculative-num-steps in turn, one step each (every switch exercised: for tests, not"
        " for serving); 'off' drafts nothing (the floor 'auto' falls back to; for measuring it)."
        " Default: 'auto' where the launch runs its steps in order with a chain (every CPU"
        " launch: its defaults turn the overlap scheduler off), else 'fixed' (a tree, or"
        " SGLang's overlap scheduler, which 'auto' turns off). Under --tp-size > 1 tensor"
        " rank 0 decides and every rank runs its choice.",
        choices=CHAIN_STEPS_MODES,
        requires="STANDALONE_FULL",
    )


FLAGS = StandaloneFlags


def default_steps_mode(eagle_topk: int | None, overlap: bool | None, device: str) -> str:
    """``--standalone-steps`` where the user gave none: the controller wherever it runs without
    taking anything from the launch (a chain, and steps in order already: the overlap scheduler
    off, or a CPU launch, whose defaults turn it off), else the fixed chain."""
    in_order = overlap is False or (overlap is None and device == "cpu")
    return "auto" if eagle_topk in (None, 1) and in_order else "fixed"
