"""A drafter forward's heads served on the CPU in one native call.

The final RMSNorm, the LM head over the draft vocabulary, each position's top candidates
mapped to target ids with their draft log-probabilities (what a tree round reads), and the
rank head over the normed state and the distribution summary psi(p): ``drafter_heads``
(``cpu_kernels/csrc/drafter_heads.cpp``), equal to the modules to float32 rounding
(``tests/unit/test_specblock_native_drafter.py``). Elsewhere (no native op, training, other
devices, a proposal not asked for) the modules run as before.
"""

from __future__ import annotations

import torch

from sgl_spec.cpu_kernels import native
from sgl_spec.patches import cpu_packed_linear
from sgl_spec.specblock.fast_layer import _fused, _Packed, rms_norm
from sgl_spec.specblock.tree import BlockProposal


def served_heads(
    model: torch.nn.Module,
    hidden: torch.Tensor,  # [bs, S, K, d] last-layer states
    fast: bool,  # the CPU serving path ran the layers (serving_on_cpu)
    propose: int,  # > 0: also the top ``propose`` candidates of each position
) -> tuple[torch.Tensor, torch.Tensor | None, BlockProposal | None]:
    """The drafter's final norm, LM head and rank head: logits [bs, S, K, V_d], rank logits
    [bs, S, K, 4] (None without a rank head), and with ``propose`` a :class:`BlockProposal`
    of [bs * S, K, W] rows (its buckets left to the caller, from the rank logits). On the CPU
    serving path with ``propose`` all of it is one native call (``drafter_heads``,
    ``csrc/drafter_heads.cpp``); elsewhere the modules, and no proposal
    (``drafting._round_proposal`` computes it from the logits)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    heads = _heads_state(model) if fast and propose > 0 else None
    lm = None if heads is None else heads["lm"].current()
    if lm is None or not lm.takes(rows.shape[0]):
        normed = rms_norm(model.norm, hidden, fast)
        logits = model.lm_head(normed)
        rank = None if model.rank_head is None else model.rank_head(normed, logits)
        return logits, rank, None
    rank_head = model.rank_head
    first, second = (None, None) if rank_head is None else (rank_head.net[0], rank_head.net[2])
    logits, rank, top_ids, top_lp = native.ops().drafter_heads(
        rows,
        model.norm.weight,
        model.norm.variance_epsilon,
        lm.packed,
        model.lm_head.weight.shape[0],
        model.d2t,
        propose,
        None if first is None else heads["rank"].current().packed,
        None if first is None else first.bias,
        0 if first is None else first.weight.shape[0],
        None if second is None else second.weight,
        None if second is None else second.bias,
    )
    bs, s, k = hidden.shape[:3]
    rank = None if rank_head is None else rank.view(bs, s, k, -1)
    proposal = BlockProposal(top_ids.view(bs * s, k, -1), top_lp.view(bs * s, k, -1), None)
    return logits.view(bs, s, k, -1), rank, proposal


def _heads_state(model: torch.nn.Module) -> dict[str, _Packed] | None:
    """The heads' packed weights for ``drafter_heads``, or None where that call cannot serve
    them (no native op or kernel, biases or an activation the op does not compute)."""
    if not hasattr(native.ops(), "drafter_heads") or cpu_packed_linear.kind() != "native":
        return None
    state = getattr(model, "_sgl_spec_heads", None)
    if state is None:
        state = False
        rank_head = model.rank_head
        net = None if rank_head is None else rank_head.net
        if model.lm_head.bias is None and (
            net is None or (isinstance(net[1], torch.nn.SiLU) and net[2].out_features == 4)
        ):
            state = {"lm": _fused([model.lm_head], "native")}
            if net is not None:
                state["rank"] = _fused([net[0]], "native")
        model._sgl_spec_heads = state
    return state or None
