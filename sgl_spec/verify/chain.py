"""Lossless acceptance of a chain of deterministic drafts (one candidate per position).

Greedy: draft i is accepted iff it equals the target's argmax after the verified prefix; the
bonus is the target's argmax after the last accepted draft. Sampling: the rejection rule with a
point-mass draft (accept d with probability p(d), else draw from p with d removed, renormalised),
which emits every token with probability p(token) -- through the tree kernel's API (a chain is a
tree with one child per node), so GPU hosts run SGLang's CUDA kernel and CPU hosts our PyTorch
twin (``sgl_spec/verify/tree_sampling.py``).

"Accepted" counts drafts only; the acceptance length of a step is ``num_accepted + 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChainResult:
    num_accepted: torch.Tensor  # [bs] accepted drafts (bonus excluded)
    tokens: torch.Tensor  # [bs, k+1] accepted drafts then the bonus, padded with 0
    bonus: torch.Tensor  # [bs]


def accept_greedy(drafts: torch.Tensor, target_argmax: torch.Tensor) -> ChainResult:
    """drafts: [bs, k]; target_argmax: [bs, k+1] (row i = argmax after anchor i)."""
    bs, k = drafts.shape
    matches = drafts == target_argmax[:, :k]
    num_accepted = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
    bonus = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return ChainResult(num_accepted, _pack(drafts, num_accepted, bonus), bonus)


def accept_sampling(
    drafts: torch.Tensor,  # [bs, k]
    anchors0: torch.Tensor,  # [bs] the token already verified (chain root)
    target_probs: torch.Tensor,  # [bs, k+1, vocab] filtered, renormalised
    coins: torch.Tensor,  # [bs, k+1] one uniform per node
    final_coins: torch.Tensor,  # [bs]
    sampler: Callable[..., None],
) -> ChainResult:
    """Rejection sampling along the chain via ``tree_speculative_sampling_target_only``."""
    bs, k = drafts.shape
    width = k + 1
    device = drafts.device
    candidates = torch.cat((anchors0[:, None], drafts), dim=1).to(torch.int64)
    slots = torch.arange(width, dtype=torch.int64, device=device)
    retrive_index = (torch.arange(bs, device=device)[:, None] * width + slots).to(torch.int64)
    retrive_next_token = torch.where(slots + 1 < width, slots + 1, -1).expand(bs, width)
    retrive_next_sibling = torch.full((bs, width), -1, dtype=torch.int64, device=device)
    predicts = torch.zeros(bs * width, dtype=torch.int32, device=device)
    accept_index = torch.full((bs, width), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(bs, dtype=torch.int32, device=device)
    sampler(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrive_index=retrive_index,
        retrive_next_token=retrive_next_token.contiguous(),
        retrive_next_sibling=retrive_next_sibling,
        uniform_samples=coins,
        uniform_samples_for_final_sampling=final_coins,
        target_probs=target_probs,
        draft_probs=torch.zeros_like(target_probs),
    )
    num_accepted = accept_token_num.to(torch.int64)
    # predicts[slot] = the token emitted after that slot; the accepted path is slots 0..n.
    emitted = predicts.view(bs, width).to(torch.int64)
    bonus = emitted.gather(1, num_accepted[:, None]).squeeze(1)
    return ChainResult(num_accepted, _pack(drafts, num_accepted, bonus), bonus)


def _pack(drafts: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """[bs, k+1]: drafts[:n], bonus, zeros."""
    bs, k = drafts.shape
    out = torch.zeros((bs, k + 1), dtype=torch.int64, device=drafts.device)
    out[:, :k] = drafts
    cols = torch.arange(k + 1, device=drafts.device)[None, :]
    out = torch.where(cols < num_accepted[:, None], out, 0)
    return out.scatter(1, num_accepted[:, None], bonus[:, None].to(torch.int64))
