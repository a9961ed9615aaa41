"""How often a draft's greedy tokens match the target's along the target's own greedy
continuation: the acceptance rates every held-out evaluation reports (the shipped draft's
``draft_agreement``, the MTP adapter's ``mask_agreement``, the SpecBlock drafter's
``chain_acceptance``).

A *chain* is the run of draft positions after one start; position ``k`` of it is right when
the draft's argmax equals the target's greedy token there. Speculative decoding accepts the
leading right positions of a chain, so the rates of interest are

- ``prefix_correct[k]``: P(positions 1..k all right);
- the conditional α_k = P(position k right | positions 1..k-1 right)
  = ``prefix_correct[k] / prefix_correct[k-1]``;
- ``expected_acceptance_length[k]``: ``1 + Σ_{j≤k} prefix_correct[j]``, tokens per verifier call
  (bonus token included) with chains of ``k`` drafts from uniformly spread starts.

``acceptance_rates`` gives α_k as exact ratios of counts (the pair's card), ``prefix_rates``
all three as fp32 means rounded to 4 digits (the adapter and drafter cards).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def prefix_hits(correct: torch.Tensor) -> torch.Tensor:  # [..., depth] bool -> [..., depth] int64
    """1 at chain position ``k`` while positions ``1..k`` are all right, 0 from the first miss."""
    return correct.long().cumprod(-1)


def round_rates(values: Iterable[float | torch.Tensor], digits: int = 4) -> list[float]:
    """Rates as the metrics JSON holds them: Python floats rounded to ``digits``."""
    return [round(float(x), digits) for x in values]


def prefix_rates(correct: torch.Tensor) -> dict[str, list[float]]:  # [num_chains, depth] bool
    """``prefix_correct``, ``conditional`` (α_k; 0 where no chain got that far) and
    ``expected_acceptance_length`` of the module docstring, rounded."""
    prefix = prefix_hits(correct).float().mean(0)  # [depth]
    before = torch.cat([torch.ones(1), prefix[:-1]])
    conditional = torch.where(before > 0, prefix / before.clamp_min(1e-12), torch.zeros(()))
    return {
        "prefix_correct": round_rates(prefix),
        "conditional": round_rates(conditional),
        "expected_acceptance_length": [round(1 + float(x), 4) for x in prefix.cumsum(0)],
    }


def acceptance_rates(
    matches: torch.Tensor,  # [n, g] bool: draft argmax == target token, per continuation position
    max_k: int,
) -> list[float]:
    """α_1..α_max_k from a teacher-forced match matrix, over every start position.

    The chain of start ``s`` is ``matches[s : s+max_k]``; α_k is the share of the chains right
    at positions ``1..k-1`` that are right at ``k`` too (0.0 where none got that far).
    """
    n, g = matches.shape
    if g < max_k:
        raise ValueError(f"continuation of {g} tokens is shorter than max_k={max_k}")
    chains = matches.unfold(1, max_k, 1)  # [n, g - max_k + 1, max_k]
    counts = [n * chains.shape[1], *prefix_hits(chains).sum((0, 1)).tolist()]
    return [
        hit / eligible if eligible else 0.0
        for eligible, hit in zip(counts[:-1], counts[1:], strict=True)
    ]


def expected_acceptance_length(alphas: list[float]) -> list[float]:
    """Tokens per verify step (bonus included) for chain drafts of 1..K tokens: 1 + sum of prod(alpha)."""
    lengths, prod, acc = [], 1.0, 1.0
    for a in alphas:
        prod *= a
        acc += prod
        lengths.append(acc)
    return lengths
