"""Multi-candidate rejection sampling over a draft tree whose drafts are deterministic
("target-only": the draft distribution is a point mass on each proposed token).

Math (SpecInfer-style, one uniform coin per tree level): at the current node with target
distribution p, the sibling candidates c_1..c_m take consecutive intervals of [0, 1) of widths
p(c_1), ..., p(c_m); the coin picks the candidate whose interval it falls in, which happens with
probability exactly p(c_i). If it lands past them all, the bonus token is drawn from p with
the rejected candidates removed and renormalised, i.e. from p restricted to the rest, whose
mass is exactly the coin's remaining probability. Every token therefore appears with
probability p(token): the output distribution equals the target's.

``tree_speculative_sampling_target_only`` has the signature of SGLang's CUDA kernel of the same
name (``sglang/kernels/ops/speculative/sampling.py``) so it can stand in on CPU hosts.
"""

from __future__ import annotations

import torch


def filter_probs(
    probs: torch.Tensor,  # [n, vocab] softmax(logits / temperature)
    top_ks: torch.Tensor | None,  # [n]
    top_ps: torch.Tensor | None,  # [n]
) -> torch.Tensor:
    """Top-k then top-p truncation, renormalised; the same rule as SGLang's PyTorch sampler
    (``top_k_top_p_min_p_sampling_from_probs_torch``): rank >= k dropped, then any token whose
    preceding sorted mass exceeds top_p dropped."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    if top_ks is not None:
        ranks = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
        probs_sort = probs_sort.masked_fill(ranks >= top_ks.view(-1, 1), 0.0)
    if top_ps is not None:
        before = torch.cumsum(probs_sort, dim=-1) - probs_sort
        probs_sort = probs_sort.masked_fill(before > top_ps.view(-1, 1), 0.0)
    out = torch.zeros_like(probs).scatter_(-1, probs_idx, probs_sort)
    return out / out.sum(dim=-1, keepdim=True)


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    return filter_probs(probs, top_ks, None)


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    return filter_probs(probs, None, top_ps)


def sample_from(probs: torch.Tensor, coin: float) -> int:
    """Inverse-CDF draw from an (unnormalised) non-negative vector."""
    cdf = torch.cumsum(probs.double(), dim=0)
    total = float(cdf[-1])
    if total <= 0:
        return int(probs.shape[0] - 1)
    idx = int(torch.searchsorted(cdf, torch.tensor([coin * total], dtype=cdf.dtype), right=True))
    idx = min(idx, probs.shape[0] - 1)
    while idx > 0 and float(probs[idx]) <= 0:  # land on a token with mass
        idx -= 1
    return idx


def _walk_siblings(
    child: int,  # first child of the current node, -1 for none
    next_sibling: list[int],  # [num_draft_tokens]
    tokens: list[int],  # [num_draft_tokens]
    probs: torch.Tensor,  # [vocab] target distribution at the current node
    coin: float,
    threshold_single: float,
    threshold_acc: float,
) -> tuple[int, list[int]]:
    """The siblings take consecutive intervals of [0, 1) of width p(token); the child whose
    interval holds the coin is accepted. Returns it (-1 for none) and the tokens passed over."""
    prob_acc = 0.0
    rejected: list[int] = []
    while child != -1:
        token = tokens[child]
        p = float(probs[token])
        prob_acc += p
        if p > 0 and (coin < prob_acc / threshold_acc or p >= threshold_single):
            return child, rejected
        rejected.append(token)
        child = next_sibling[child]
    return -1, rejected


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,  # [bs * num_draft_tokens] out: token per tree slot
    accept_index: torch.Tensor,  # [bs, num_spec_steps] out: accepted slots, -1 padded
    accept_token_num: torch.Tensor,  # [bs] out: accepted drafts (bonus excluded)
    candidates: torch.Tensor,  # [bs, num_draft_tokens] tree tokens, slot 0 = last verified
    retrive_index: torch.Tensor,  # [bs, num_draft_tokens] slot -> flat index
    retrive_next_token: torch.Tensor,  # [bs, num_draft_tokens] first child or -1
    retrive_next_sibling: torch.Tensor,  # [bs, num_draft_tokens] next sibling or -1
    uniform_samples: torch.Tensor,  # [bs, num_draft_tokens] one coin per tree node
    uniform_samples_for_final_sampling: torch.Tensor,  # [bs]
    target_probs: torch.Tensor,  # [bs, num_draft_tokens, vocab]
    draft_probs: torch.Tensor,  # [bs, num_draft_tokens, vocab] scratch (zeros)
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """In-place outputs like the CUDA kernel. Thresholds below 1 trade exactness for
    acceptance (as upstream); at the default 1.0 the rule is lossless."""
    bs, num_draft_tokens = candidates.shape
    num_spec_steps = accept_index.shape[1]
    cand = candidates.tolist()
    r_index = retrive_index.tolist()
    r_next = retrive_next_token.tolist()
    r_sib = retrive_next_sibling.tolist()
    coins = uniform_samples.reshape(bs, num_draft_tokens).tolist()
    final_coins = uniform_samples_for_final_sampling.reshape(bs).tolist()
    for b in range(bs):
        node = 0
        last_flat = r_index[b][0]
        accept_index[b, 0] = last_flat
        coin = coins[b][0]
        num_accepted = 0
        rejected: list[int] = []
        for step in range(1, num_spec_steps):
            accepted_child, rejected = _walk_siblings(
                r_next[b][node], r_sib[b], cand[b], target_probs[b, node], coin,
                threshold_single, threshold_acc,
            )  # fmt: skip
            if accepted_child == -1:
                break
            predicts[last_flat] = cand[b][accepted_child]
            num_accepted += 1
            last_flat = r_index[b][accepted_child]
            accept_index[b, step] = last_flat
            node = accepted_child
            coin = coins[b][accepted_child]
            rejected = []
        accept_token_num[b] = num_accepted
        residual = target_probs[b, node].clone()
        if rejected and num_accepted != num_spec_steps - 1:
            residual[torch.tensor(rejected, dtype=torch.long)] = 0.0
        predicts[last_flat] = sample_from(residual, final_coins[b])
