"""Rank head of the SpecBlock drafter (paper §3.2, App. B) and its bucket rules.

The rank head predicts, per draft position, how deep the target token sits in the draft
distribution, as one of four coarse buckets: ``r = 1 -> b0``, ``r in [2, 4] -> b1``,
``r in [5, 10] -> b2``, ``r > 10 -> b3`` (§3.3, "Rank-head supervision"). Its input is the
detached last hidden state and the 15-dim summary ``psi(p)`` of the draft distribution (App. B).
"""

from __future__ import annotations

import torch
from torch import nn

NUM_BUCKETS = 4
PSI_DIM = 15
# Upper rank (1-based, inclusive) of buckets b0, b1, b2; everything deeper is b3 (§3.3).
BUCKET_UPPER_RANKS = (1, 4, 10)
_GAP_RANKS = (2, 3, 5)  # App. B: logit gaps between the top token and ranks 2, 3 and 5


def psi_features(
    probs: torch.Tensor,  # [..., V] a probability distribution over the (draft) vocabulary
) -> torch.Tensor:  # [..., 15]
    """The 15-dim distribution summary ``psi(p)`` of App. B, in this order:

    - dims 0-9: log-probabilities of the top-10 tokens (descending),
    - dims 10-12: logit gaps between the top token and its rank-2, rank-3 and rank-5
      competitors; a softmax is shift-invariant, so the logit gap equals the log-probability
      gap ``log p_(1) - log p_(r)``,
    - dim 13: probability of the top token,
    - dim 14: entropy ``-sum_v p(v) log p(v)`` of the whole distribution (``0 log 0 = 0``).

    Zero probabilities enter logs as the smallest positive normal of the dtype, so every
    feature stays finite. Needs ``V >= 10``.
    """
    if probs.shape[-1] < 10:
        raise ValueError(f"psi_features needs a vocabulary of at least 10, got {probs.shape[-1]}")
    floor = torch.finfo(probs.dtype).tiny
    top_p = probs.topk(10, dim=-1).values  # [..., 10]
    top_lp = top_p.clamp_min(floor).log()
    gaps = torch.stack([top_lp[..., 0] - top_lp[..., r - 1] for r in _GAP_RANKS], dim=-1)
    entropy = -torch.special.xlogy(probs, probs).sum(-1, keepdim=True)
    return torch.cat([top_lp, gaps, top_p[..., :1], entropy], dim=-1)


def rank_to_bucket(
    rank: torch.Tensor,  # [...] 1-based rank of the target token in the draft distribution
) -> torch.Tensor:  # [...] long in {0, 1, 2, 3}
    """Bucket label of §3.3: ``1 -> 0``, ``2..4 -> 1``, ``5..10 -> 2``, ``> 10 -> 3``."""
    if (rank < 1).any():
        raise ValueError("ranks are 1-based")
    bounds = torch.tensor(BUCKET_UPPER_RANKS, device=rank.device, dtype=rank.dtype)
    return torch.bucketize(rank, bounds, right=False).long()


def target_rank(
    logits: torch.Tensor,  # [..., V_d] draft logits
    target_ids: torch.Tensor,  # [...] target token as a draft-vocabulary id, -1 if not in it
) -> torch.Tensor:  # [...] long, 1-based; V_d + 1 when the target token is outside the vocab
    """1-based rank of the target token in the draft distribution (ties count in its favour).

    A target token outside the reduced draft vocabulary ranks below every draft token.
    """
    inside = target_ids >= 0
    picked = logits.gather(-1, target_ids.clamp_min(0).unsqueeze(-1))  # [..., 1]
    rank = (logits > picked).sum(-1) + 1
    return torch.where(inside, rank, logits.shape[-1] + 1)


class RankHead(nn.Module):
    """``g_phi([sg(h), sg(psi(p))])`` of Eq. (4): a two-layer MLP over the detached state and
    the detached distribution summary, producing logits over the four buckets. The paper does
    not fix the head's shape; a SiLU MLP with ``hidden_size`` units is used here."""

    def __init__(self, state_size: int, hidden_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(state_size + PSI_DIM, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, NUM_BUCKETS),
        )

    def forward(
        self,
        state: torch.Tensor,  # [..., d] last-layer drafter state
        draft_logits: torch.Tensor,  # [..., V_d]
    ) -> torch.Tensor:  # [..., 4]
        with torch.no_grad():
            psi = psi_features(draft_logits.detach().float().softmax(-1))
        features = torch.cat([state.detach(), psi.to(state.dtype)], dim=-1)
        return self.net(features)
