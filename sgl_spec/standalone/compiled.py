"""STANDALONE_FULL's compiled forwards (``--enable-torch-compile`` on CPU;
``sgl_spec/common/compiled_forwards.py``): the target's verify of every chain width the step
policy may pick, and its plain decode where the policy may run steps without drafts; the draft
model's decode, which runs ``steps - 1`` times a step and once for a request fresh from prefill.
A tree (``--speculative-eagle-topk`` > 1) verifies under a mask and stays eager."""

from __future__ import annotations

import logging
from typing import Any

from sgl_spec.common import compiled_forwards

logger = logging.getLogger(__name__)


def target_widths(mode: str | None, steps: int, num_draft_tokens: int) -> tuple[list[int], bool]:
    """The verify widths a STANDALONE_FULL step may run at ``--standalone-steps mode``, and
    whether it may run a plain decode step instead."""
    if mode in (None, "fixed"):
        return [num_draft_tokens], False
    if mode == "off":
        return [], True
    return list(range(2, steps + 2)), True  # auto, cycle: 1 .. steps drafts, or none


def compile_forwards(draft_worker: Any) -> None:
    """Compile the target's and the draft model's forwards for ``draft_worker``'s server, where
    it asked for compiled forwards."""
    from sgl_spec.config import process_config

    target = draft_worker.target_worker.model_runner
    if not compiled_forwards.compile_requested(target):
        return
    if draft_worker.topk != 1:
        logger.warning("STANDALONE_FULL: a tree (--speculative-eagle-topk %d) verifies eager",
                       draft_worker.topk)  # fmt: skip
        return
    sizes = compiled_forwards.capture_batch_sizes(target)
    steps = draft_worker.speculative_num_steps
    widths, decode = target_widths(process_config().standalone_steps, steps,
                                   draft_worker.speculative_num_draft_tokens)  # fmt: skip
    compiled_forwards.compile_stacks(
        target, "target", compiled_forwards.chain_shapes(sizes, widths, decode)
    )
    compiled_forwards.compile_stacks(
        draft_worker.draft_runner,
        "draft",
        compiled_forwards.chain_shapes(sizes, [], True, draft_steps=steps > 1),
    )
