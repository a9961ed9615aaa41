"""Request sampling options on a verify tree, as plain decoding applies them: each node's own
penalties (``sgl_spec.verify.penalties``) and the grammar mask along its path.

Used by SGLang's EAGLE verify (STANDALONE, SPECBLOCK, MINEDRAFT; ``patches/spec_penalties``)
and by MTP_LORA's chain verify.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from sgl_spec.verify.penalties import Penalties, penalize_tree

logger = logging.getLogger(__name__)


def request_penalties(req: Any) -> Penalties:
    """A request's penalty settings; the stop tokens ``min_new_tokens`` bans are SGLang's
    (``BatchedMinNewTokensPenalizer``): its stop ids, EOS ids and the tokenizer's."""
    params = req.sampling_params
    stops: set[int] = set()
    if params.min_new_tokens > 0:
        tokenizer = getattr(req, "tokenizer", None)
        stops |= set(params.stop_token_ids or ()) | set(req.eos_token_ids or ())
        if tokenizer is not None:
            stops |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
            stops.add(getattr(tokenizer, "eos_token_id", None))
    return Penalties(
        frequency=float(params.frequency_penalty),
        presence=float(params.presence_penalty),
        repetition=float(params.repetition_penalty),
        min_new_tokens=int(params.min_new_tokens),
        stop_token_ids=tuple(sorted(t for t in stops if t is not None)),
    )


def penalize_verify_logits(
    reqs: list[Any],
    logits: torch.Tensor,  # [bs * W, vocab], penalized in place
    tokens: torch.Tensor,  # [bs, W] node tokens, node 0 the root (the bonus token)
    parents: Callable[[], torch.Tensor],  # -> [bs, W] parent node, -1 at the root
) -> bool:
    """Each node's own penalties from each request's committed outputs and its draft path.
    False (nothing done) when no request has a penalty, or when the requests' outputs do not
    end at the roots (an overlapped scheduler that has not committed the last step yet): the
    caller then applies SGLang's step-start penalties. ``parents`` is only called when some
    request has a penalty."""
    penalties = [request_penalties(req) for req in reqs]
    if not any(p.active for p in penalties):
        return False
    committed = [list(req.output_ids) for req in reqs]
    roots = tokens[:, 0].tolist()
    if any(not out or out[-1] != root for out, root in zip(committed, roots, strict=True)):
        _warn_relaxed()
        return False
    penalize_tree(logits, tokens, parents(), committed, penalties)
    return True


@functools.cache
def _warn_relaxed() -> None:
    logger.warning(
        "penalties: request outputs lag the verify roots (overlap scheduling);"
        " SGLang's step-start penalties apply to every node of the verify tree"
    )


def apply_grammar_mask(batch: Any, logits: torch.Tensor, tree: Any) -> None:
    """SGLang's constrained-decoding mask over a verify tree (``spec_utils.GrammarTree``):
    each node allows what the grammar allows after its path."""
    if not batch.has_grammar:
        return
    from sglang.srt.speculative.spec_utils import build_grammar_vocab_mask

    mask = build_grammar_vocab_mask(
        reqs=batch.reqs,
        tree=tree,
        sampling_info=batch.sampling_info,
        device=logits.device,
        barrier=None,
    )
    if mask is not None:
        mask.apply(logits)


def needs_logit_processing(batch: Any) -> bool:
    """Whether any request's verify logits change before sampling (penalties, logit_bias,
    a grammar)."""
    info = batch.sampling_info
    return (
        info.acc_additive_penalties is not None
        or info.acc_scaling_penalties is not None
        or info.logit_bias is not None
        or bool(batch.has_grammar)
    )


def process_chain_logits(
    batch: Any,
    logits: torch.Tensor,  # [bs * W, vocab] verify logits, changed in place
    chain: torch.Tensor,  # [bs, W] the chain's tokens: the bonus token, then the drafts
) -> None:
    """What SGLang's EAGLE verify (with ``patches/spec_penalties``) does to a tree's logits,
    for a chain: each position's penalties, ``logit_bias``, the grammar mask."""
    from sglang.srt.speculative.spec_utils import GrammarTree

    from sgl_spec.verify.penalties import chain_parents

    info = batch.sampling_info
    bs, width = chain.shape
    if not penalize_verify_logits(
        batch.reqs, logits, chain, lambda: chain_parents(bs, width, chain.device)
    ):
        if info.acc_additive_penalties is not None:
            logits.add_(torch.repeat_interleave(info.acc_additive_penalties, width, dim=0))
        if info.acc_scaling_penalties is not None:
            scale = torch.repeat_interleave(info.acc_scaling_penalties, width, dim=0)
            logits.copy_(torch.where(logits < 0, logits * scale, logits / scale))
    if info.logit_bias is not None:
        logits.add_(torch.repeat_interleave(info.logit_bias, width, dim=0))
    if batch.has_grammar:
        apply_grammar_mask(batch, logits, GrammarTree.from_linear_chain(chain.cpu()))
