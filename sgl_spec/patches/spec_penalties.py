"""Patch: sampling penalties in SGLang's EAGLE verify as plain decoding applies them.

Upstream target: ``sglang.srt.speculative.eagle_worker_common.eagle_sample`` (SGLang 0.5.23),
the verify of STANDALONE, SPECBLOCK and MINEDRAFT. SGLang applies one step-start penalty to
every node of the verify tree ("a relaxed version of penalties for speculative decoding") and
its scheduler then feeds the penalizers only the last token of each step, so frequency,
presence and repetition penalties ignore every draft accepted before the last one, and
``min_new_tokens`` bans stop tokens for that many *steps*: greedy output under speculation
differs from plain decoding's, and sampled output does not follow the penalized law.

The patched ``eagle_sample`` penalizes each node for the request's committed outputs plus the
drafts on its path (``sgl_spec.common.sampling.penalize_verify_logits``) and skips SGLang's
step-start penalties; batches without penalties take SGLang's path unchanged.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.speculative.eagle_worker_common"
_PARAMS = ["verify_input", "batch", "logits_output", "grammar_mask", "uno_target_max_top_k"]
# The penalizers SGLang has; sgl_spec.verify.penalties computes what each of them does.
_PENALIZERS = {
    "BatchedFrequencyPenalizer",
    "BatchedMinNewTokensPenalizer",
    "BatchedPresencePenalizer",
    "BatchedRepetitionPenalizer",
}


def enabled(config: SpecConfig) -> bool:
    return True  # a correctness fix: plain decoding's penalties, whatever the algorithm


def _module() -> ModuleType:
    import importlib

    return importlib.import_module(TARGET)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    from sglang.srt.speculative import eagle_utils

    sample = getattr(_module(), "eagle_sample", None)
    if sample is None:
        raise RuntimeError(f"{TARGET} no longer imports eagle_sample")
    params = list(inspect.signature(getattr(sample, "__wrapped__", sample)).parameters)
    if params[: len(_PARAMS)] != _PARAMS:
        raise RuntimeError(f"{TARGET}.eagle_sample params: {params}")
    from sglang.srt.sampling import penaltylib

    penalizers = {name for name in penaltylib.__all__ if name.endswith("Penalizer")}
    if penalizers != _PENALIZERS:
        raise RuntimeError(f"SGLang's penalizers changed: {sorted(penalizers)}")
    source = inspect.getsource(eagle_utils.eagle_sample)
    for field in ("acc_additive_penalties", "acc_scaling_penalties", "retrieve_next_sibling"):
        if field not in source:
            raise RuntimeError(f"eagle_sample no longer reads {field}: patch needs updating")


def exact_penalties(original: Callable) -> Callable:
    """``original`` (``eagle_sample``) on logits that carry each node's own penalties."""

    @functools.wraps(original)
    def eagle_sample(verify_input, batch, logits_output, *args, **kwargs):
        if batch.forward_mode.is_idle() or not _penalize(verify_input, batch, logits_output):
            return original(verify_input, batch, logits_output, *args, **kwargs)
        info = batch.sampling_info
        saved = info.acc_additive_penalties, info.acc_scaling_penalties
        info.acc_additive_penalties = info.acc_scaling_penalties = None
        try:
            return original(verify_input, batch, logits_output, *args, **kwargs)
        finally:
            info.acc_additive_penalties, info.acc_scaling_penalties = saved

    eagle_sample._sgl_spec_exact_penalties = True  # type: ignore[attr-defined]
    return eagle_sample


def _penalize(verify_input, batch, logits_output) -> bool:
    from sgl_spec.common.sampling import penalize_verify_logits
    from sgl_spec.verify.penalties import tree_parents

    bs, width = len(batch.reqs), verify_input.draft_token_num
    device = verify_input.draft_token.device
    return penalize_verify_logits(
        batch.reqs,
        logits_output.next_token_logits,
        verify_input.draft_token.view(bs, width),
        lambda: tree_parents(
            verify_input.retrieve_next_token.to(device),
            verify_input.retrieve_next_sibling.to(device),
        ),
    )


def apply() -> bool:
    """Wrap ``eagle_sample`` where ``run_eagle_verify`` calls it; idempotent."""
    check()
    mod = _module()
    if not getattr(mod.eagle_sample, "_sgl_spec_exact_penalties", False):
        mod.eagle_sample = exact_penalties(mod.eagle_sample)
    return True
