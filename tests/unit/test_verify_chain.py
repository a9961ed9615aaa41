"""Chain acceptance (sgl_spec/verify/chain.py): constructed cases and an exact-law check of the
sampling rule through the PyTorch twin of SGLang's tree sampling kernel."""

from __future__ import annotations

import torch
from scipy import stats

from sgl_spec.verify.chain import accept_greedy, accept_sampling
from sgl_spec.verify.tree_sampling import tree_speculative_sampling_target_only


def test_greedy_accepts_the_matching_prefix_and_emits_the_bonus() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 2, 8]])
    res = accept_greedy(drafts, target)
    assert res.num_accepted.tolist() == [3, 1, 0, 2]
    assert res.bonus.tolist() == [8, 6, 5, 2]
    assert res.tokens.tolist() == [[5, 6, 7, 8], [5, 6, 0, 0], [5, 0, 0, 0], [5, 6, 2, 0]]


def test_greedy_with_no_drafts_is_plain_decoding() -> None:
    res = accept_greedy(torch.zeros((2, 0), dtype=torch.long), torch.tensor([[4], [9]]))
    assert res.num_accepted.tolist() == [0, 0]
    assert res.tokens.tolist() == [[4], [9]]


def _sample(probs: torch.Tensor, drafts: torch.Tensor, num: int, seed: int) -> list[tuple]:
    """Run the sampling rule ``num`` times for one request; returns (num_accepted, tokens)."""
    gen = torch.Generator().manual_seed(seed)
    bs = num
    k = drafts.shape[0]
    out = accept_sampling(
        drafts.expand(bs, k).clone(),
        torch.zeros(bs, dtype=torch.long),
        probs.expand(bs, *probs.shape).clone(),
        torch.rand((bs, k + 1), generator=gen),
        torch.rand(bs, generator=gen),
        tree_speculative_sampling_target_only,
    )
    return list(zip(out.num_accepted.tolist(), map(tuple, out.tokens.tolist()), strict=True))


def test_sampling_emits_exactly_the_target_law_for_the_first_token() -> None:
    """Token after the root: accepted draft with probability p(d), else p without d renormalised;
    overall exactly p. Chi-square at alpha 1e-4 against p (4000 draws)."""
    probs = torch.tensor(
        [
            [0.1, 0.5, 0.3, 0.1],  # after the root
            [0.25, 0.25, 0.25, 0.25],  # after draft 1
            [0.7, 0.1, 0.1, 0.1],  # after draft 2
        ]
    )
    drafts = torch.tensor([2, 0])  # draft 1 = token 2 (p = 0.3), draft 2 = token 0
    runs = _sample(probs, drafts, 4000, seed=0)
    first = torch.tensor([tokens[0] for _, tokens in runs])
    counts = torch.bincount(first, minlength=4).double()
    expected = probs[0].double() * len(runs)
    assert stats.chisquare(counts, expected).pvalue > 1e-4
    accepted_first = sum(1 for n, _ in runs if n >= 1) / len(runs)
    assert abs(accepted_first - 0.3) < 0.04


def test_sampling_second_token_follows_the_accepted_path() -> None:
    """Given draft 1 accepted, token 2 has law p(. | draft 1); given it rejected, the first
    token is the residual and there is no second token from this step."""
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.2, 0.2, 0.2, 0.4], [0.5, 0.5, 0.0, 0.0]])
    drafts = torch.tensor([2, 3])  # draft 1 always accepted (p = 1)
    runs = _sample(probs, drafts, 4000, seed=1)
    assert all(n >= 1 and tokens[0] == 2 for n, tokens in runs)
    second = torch.tensor([tokens[1] for _, tokens in runs])
    counts = torch.bincount(second, minlength=4).double()
    assert stats.chisquare(counts, probs[1].double() * len(runs)).pvalue > 1e-4
    # draft 2 (token 3) accepted with p = 0.4; then the bonus comes from row 2
    both = [tokens for n, tokens in runs if n == 2]
    assert abs(len(both) / len(runs) - 0.4) < 0.04
    assert {t[2] for t in both} <= {0, 1}


def test_sampling_rejects_a_zero_probability_draft() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    runs = _sample(probs, torch.tensor([3]), 500, seed=2)
    assert all(n == 0 and tokens[0] in (0, 1) for n, tokens in runs)
