"""SpecBlock training objective (paper §3.3, Eqs. 5-7) as pure functions of logits and labels.

- Valid-prefix mask (Eq. 5): ``m_1 = 1`` and ``m_{k+1} = m_k * 1[argmax p_k = y*_k]`` along each
  path, so a position is supervised only while every earlier position of its path was drafted
  right. Along a chain the path runs through the on-path slots of earlier blocks: block ``m``
  starts from the ground-truth token at slot ``s`` (the cut) of block ``m-1``, so its first
  position is admitted when block ``m-1``'s mask admits slot ``s`` (slots ``1..s-1`` drafted
  right). Slot ``s``'s own argmax need not be right: at inference a later block mostly starts
  from a non-top-1 sibling at that slot (``tree.expand_blocks``), whose token is the target's.
- Draft loss (Eq. 6 with the target's greedy token as ``p*``): cross-entropy at each slot,
  averaged over the positions the mask admits, summed over the K slots (Eq. 7) and averaged over
  the blocks of a chain. Target tokens outside the reduced draft vocabulary cannot be drafted:
  they get no cross-entropy term (and end the valid prefix, since they are never drafted right).
- Rank loss (§3.3): cross-entropy of the rank head against the bucket of the target token's rank
  in the draft distribution (``rank.rank_to_bucket``), under the same mask; an outside-vocabulary
  token ranks below every draft token (bucket b3, "give up").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_spec.specblock.layout import IGNORE_INDEX, gather_slot
from sgl_spec.specblock.rank import rank_to_bucket, target_rank


def target_to_draft_map(
    d2t: torch.Tensor,  # [V_d] target id of each draft id
    target_vocab_size: int,
) -> torch.Tensor:  # [V_target] draft id of each target id, -1 outside the draft vocabulary
    """Inverse of the drafter's ``d2t`` map (App. A.1 reduced vocabulary)."""
    t2d = torch.full((target_vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t.long()] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d


def to_draft_ids(
    labels: torch.Tensor,  # [...] target ids, IGNORE_INDEX where there is no label
    t2d: torch.Tensor,  # [V_target]
) -> torch.Tensor:  # [...] draft ids, -1 for no label or a token outside the draft vocabulary
    return torch.where(labels == IGNORE_INDEX, -1, t2d[labels.clamp_min(0)])


def valid_prefix_mask(
    correct: torch.Tensor,  # [..., K] bool: argmax p_k == y*_k
    initial: torch.Tensor,  # [...] bool: m_1 (is the path right up to this block's start?)
) -> torch.Tensor:  # [..., K] bool
    """Eq. (5): ``m_1 = initial``, ``m_{k+1} = m_k * correct_k``."""
    before = torch.cat([initial[..., None], correct[..., :-1]], dim=-1)
    return before.long().cumprod(-1).bool()


def chain_masks(
    correct: Sequence[torch.Tensor],  # per block m: [bs, C, K] bool
    labelled: Sequence[torch.Tensor],  # per block m: [bs, C, K] bool, a label exists
    cuts: torch.Tensor,  # [bs, C, M-1] 1-based cut at each boundary
    valid_prefix: bool = True,
) -> list[torch.Tensor]:  # per block m: [bs, C, K] bool
    """Loss masks of every block of a chain; ``valid_prefix=False`` is the Table 2 ablation
    (every labelled position counts)."""
    if not valid_prefix:
        return [lab.clone() for lab in labelled]
    masks, initial = [], torch.ones_like(correct[0][..., 0])
    for m, (ok, lab) in enumerate(zip(correct, labelled, strict=True)):
        mask = valid_prefix_mask(ok & lab, initial) & lab
        masks.append(mask)
        if m < cuts.shape[-1]:
            initial = gather_slot(mask, cuts[..., m])
    return masks


def bucket_labels(
    logits: torch.Tensor,  # [..., V_d] draft logits
    draft_labels: torch.Tensor,  # [...] draft ids, -1 outside the vocabulary
) -> torch.Tensor:  # [...] long in {0, 1, 2, 3}
    """§3.3 rank-head label: bucket of the 1-based rank of the target token in ``p``."""
    return rank_to_bucket(target_rank(logits.detach(), draft_labels))


@dataclass
class LossBreakdown:
    """One step's objective (Eq. 7) and what the logs report."""

    total: torch.Tensor  # scalar, what the optimiser minimises
    draft: torch.Tensor  # scalar
    rank: torch.Tensor | None  # scalar, None when the rank head is off (ablated or warming up)
    per_slot: list[list[float]]  # [M][K] draft cross-entropy per block and slot (nan if empty)
    accepted: list[list[float]]  # [M][K] fraction of masked positions drafted right
    num_masked: list[list[int]]  # [M][K] N_k of Eq. (6)


def block_draft_loss(
    logits: torch.Tensor,  # [bs, C, K, V_d] fp32
    draft_labels: torch.Tensor,  # [bs, C, K] draft ids, -1 outside the vocabulary / no label
    mask: torch.Tensor,  # [bs, C, K] bool
) -> tuple[torch.Tensor, list[float], list[int]]:
    """``sum_k L_k`` of Eqs. (6-7) for one block, plus the per-slot means and counts."""
    keep = mask & (draft_labels >= 0)
    ce = F.cross_entropy(
        logits.flatten(0, -2), draft_labels.clamp_min(0).flatten(), reduction="none"
    ).view(draft_labels.shape)
    ce = torch.where(keep, ce, torch.zeros((), dtype=ce.dtype, device=ce.device))
    count = keep.flatten(0, 1).sum(0)  # [K]
    per_slot = ce.flatten(0, 1).sum(0) / count.clamp_min(1)
    detached = per_slot.detach()
    means = [float(x) if n > 0 else float("nan") for x, n in zip(detached, count, strict=True)]
    return per_slot.sum(), means, [int(n) for n in mask.flatten(0, 1).sum(0)]


def chain_loss(
    logits: Sequence[torch.Tensor],  # per block m: [bs, C, K, V_d]
    rank_logits: Sequence[torch.Tensor | None],  # per block m: [bs, C, K, 4] or None
    target_labels: Sequence[torch.Tensor],  # per block m: [bs, C, K] target ids / IGNORE_INDEX
    t2d: torch.Tensor,  # [V_target]
    cuts: torch.Tensor,  # [bs, C, M-1]
    valid_prefix: bool = True,
    use_rank: bool = True,
) -> LossBreakdown:
    """Eq. (7) over a chain of M blocks: mean over blocks of ``sum_k L_k^draft``, plus the
    rank-head cross-entropy over every masked position (when ``use_rank``)."""
    logits = [x.float() for x in logits]
    draft_labels = [to_draft_ids(y, t2d) for y in target_labels]
    correct = [x.argmax(-1) == y for x, y in zip(logits, draft_labels, strict=True)]
    labelled = [y != IGNORE_INDEX for y in target_labels]
    masks = chain_masks(correct, labelled, cuts, valid_prefix)
    draft, per_slot, counts, accepted = [], [], [], []
    for x, y, mask, ok in zip(logits, draft_labels, masks, correct, strict=True):
        loss, means, n = block_draft_loss(x, y, mask)
        draft.append(loss)
        per_slot.append(means)
        counts.append(n)
        hits = (ok & mask).flatten(0, 1).sum(0).tolist()
        accepted.append([h / c if c else float("nan") for h, c in zip(hits, n, strict=True)])
    draft_total = torch.stack(draft).mean()
    rank = None
    if use_rank and all(r is not None for r in rank_logits):
        rows = [
            (r.float()[m], bucket_labels(x, y)[m])
            for r, x, y, m in zip(rank_logits, logits, draft_labels, masks, strict=True)
        ]
        scores = torch.cat([r for r, _ in rows])
        if scores.shape[0] > 0:
            rank = F.cross_entropy(scores, torch.cat([b for _, b in rows]))
        else:
            rank = scores.sum() * 0.0
    total = draft_total if rank is None else draft_total + rank
    return LossBreakdown(total, draft_total, rank, per_slot, accepted, counts)
