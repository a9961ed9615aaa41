"""STANDALONE_FULL's compiled forwards (``--enable-torch-compile`` on CPU;
``sgl_spec/common/compiled_forwards.py``): the target's verify of every chain width the step
policy may pick, and its plain decode where the policy may run steps without drafts; the draft
model's decode, which runs ``steps - 1`` times a step and once for a request fresh from prefill,
and its extend over each verify's outputs.
With a tree (``--speculative-eagle-topk`` > 1) nothing is compiled: its draft decodes run
``topk`` rows a request."""

from __future__ import annotations

import logging
from typing import Any

from sgl_spec.common import compiled_forwards
from sgl_spec.control.chain_steps import chain_widths

logger = logging.getLogger(__name__)


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
    widths, decode = chain_widths(process_config().standalone_steps or "fixed", steps)
    target_shapes = compiled_forwards.forward_shapes(sizes, widths, decode)
    # each step count has its own runtime state, its target backend planned for its width
    compiled_forwards.compile_stacks(target, "target", target_shapes, width_per_backend=True)
    draft_shapes = compiled_forwards.forward_shapes(sizes, [], True, draft_steps=steps > 1)
    # the draft's extend after each verify: the verified root and the verify's outputs
    draft_shapes += [compiled_forwards.Shape("DRAFT_EXTEND_V2", bs, n + 1) for bs in sizes
                     for n in widths]  # fmt: skip
    compiled_forwards.compile_stacks(draft_worker.draft_runner, "draft", draft_shapes)
