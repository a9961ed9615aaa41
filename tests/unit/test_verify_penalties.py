"""Per-node penalties of a verify tree (``sgl_spec.verify.penalties``): tree links to parents,
the batched computation against the node-by-node reference on random trees, and constructed
cases where a draft accepted earlier in the block must be penalized."""

from __future__ import annotations

import random

import pytest
import torch

from sgl_spec.verify.penalties import (
    Penalties,
    chain_parents,
    penalize_tree,
    penalize_tree_reference,
    tree_parents,
)


def test_tree_parents_from_first_child_and_sibling_links() -> None:
    # 0 -> {1, 2}; 1 -> {3, 5}; 3 -> {4}; a chain in the second row; unused nodes -1
    next_token = torch.tensor([[1, 3, -1, 4, -1, -1], [1, 2, 3, -1, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, 5, -1, -1], [-1] * 6])
    assert tree_parents(next_token, next_sibling).tolist() == [
        [-1, 0, 0, 1, 3, 1],
        [-1, 0, 1, 2, -1, -1],
    ]
    assert chain_parents(1, 4).tolist() == [[-1, 0, 1, 2]]


def _random_tree(width: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, width)]


@pytest.mark.parametrize("seed", range(5))
def test_batched_penalties_equal_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, width, vocab = 4, 7, 12
    parents = torch.tensor([_random_tree(width, rng) for _ in range(bs)])
    tokens = torch.randint(0, 5, (bs, width))  # few distinct tokens: many repeats
    committed = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 6))] for _ in range(bs)]
    penalties = [
        Penalties(0.5, 0.7, 1.6, 5, (0, 3)),
        Penalties(),  # none: left as it is
        Penalties(repetition=0.8),
        Penalties(frequency=-0.3, min_new_tokens=9, stop_token_ids=(4,)),
    ]
    logits = torch.randn(bs * width, vocab) * 3
    fast, slow = logits.clone(), logits.clone()
    penalize_tree(fast, tokens, parents, committed, penalties)
    penalize_tree_reference(slow, tokens, parents, committed, penalties)
    assert torch.equal(fast.isinf(), slow.isinf())
    assert torch.allclose(fast.nan_to_num(), slow.nan_to_num(), atol=1e-5)
    assert torch.equal(fast[width : 2 * width], logits[width : 2 * width])


def test_a_draft_accepted_earlier_in_the_block_is_penalized() -> None:
    """Chain root 7 -> draft 3 -> draft 3: node 2's logits see token 3 twice (frequency) and
    the root once; node 0 sees only the committed outputs."""
    tokens = torch.tensor([[7, 3, 3]])
    logits = torch.zeros(3, 8)
    penalize_tree(logits, tokens, chain_parents(1, 3), [[1, 7]], [Penalties(frequency=1.0)])
    assert logits[0, 3] == 0 and logits[1, 3] == -1 and logits[2, 3] == -2
    assert (logits[:, 7] == -1).all() and (logits[:, 1] == -1).all()


def test_min_new_tokens_ban_lifts_inside_the_block() -> None:
    """Two outputs committed, min_new_tokens 4: the nodes choosing outputs 2 and 3 ban the stop
    token, the node choosing output 4 (depth 2) no longer does."""
    tokens = torch.tensor([[5, 6, 6, 6]])
    logits = torch.zeros(4, 8)
    penalties = [Penalties(min_new_tokens=4, stop_token_ids=(0,))]
    penalize_tree(logits, tokens, chain_parents(1, 4), [[2, 5]], penalties)
    assert logits[:, 0].isinf().tolist() == [True, True, False, False]
