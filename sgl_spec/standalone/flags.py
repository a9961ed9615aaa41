"""STANDALONE_FULL's settings in ``sgl_spec.config.SpecConfig``: it takes SGLang's STANDALONE
flags for its draft shape; the launcher records that the launch asked for it, and
``--standalone-steps`` says who chooses each step's chain length."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_spec.flags import flag

STANDALONE_STEPS_MODES = ("fixed", "auto", "cycle", "off")


@dataclass(frozen=True)
class StandaloneFlags:
    standalone_full_context: bool = flag(
        False,
        "--speculative-algorithm STANDALONE_FULL",
        "STANDALONE_FULL: set by the launcher when the launch asks for it; SGLang serves"
        " STANDALONE with our draft worker in every process.",
        kind="internal",
    )
    standalone_steps: str = flag(
        "fixed",
        "--standalone-steps",
        "STANDALONE_FULL (chain, --speculative-eagle-topk 1): 'fixed' (default) drafts"
        " --speculative-num-steps tokens every step; 'auto' lets the speculation controller"
        " (sgl_spec/control) choose each step's chain length among 0 (no drafts: a plain decode"
        " step, the draft model's forwards deferred and caught up later)"
        " .. --speculative-num-steps, from the measured step time and the running acceptance"
        " per position at the current batch size, switched through SGLang's adaptive runtime"
        " states; 'cycle' takes 0 .. --speculative-num-steps in turn, one step each (every"
        " switch exercised: for tests, not for serving); 'off' drafts nothing (the floor"
        " 'auto' falls back to; for measuring it).",
        choices=STANDALONE_STEPS_MODES,
        requires="STANDALONE_FULL",
    )


FLAGS = StandaloneFlags
