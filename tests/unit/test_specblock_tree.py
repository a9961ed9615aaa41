"""SpecBlock rank-guided tree (paper §3.2, App. A.5, Algorithm 2) and its verifier inputs."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_spec.cpu_kernels.tree_ops import accept_greedy_path, first_child_and_next_sibling
from sgl_spec.specblock.tree import (
    BUCKET_MAP_FALLBACK,
    BlockProposal,
    Start,
    accepted_within_budgets,
    branch_widths,
    expand_blocks,
    propose_from_logits,
    prune_to_budget,
)
from sgl_spec.verify.tree import DraftTree
from tests.helpers.references import (
    ancestor_mask,
    build_verify_input,
    greedy_verify_walk,
    grow_tree,
)

K, W = 3, 10


def proposal(buckets: list[list[int]] | None, base: int = 100) -> BlockProposal:
    """Token ``base + 100*row + 10*slot + j`` is the j-th best at (row, slot); logprob -(j+1)/10."""
    n = 1 if buckets is None else len(buckets)
    row = torch.arange(n)[:, None, None]
    slot = torch.arange(K)[None, :, None]
    j = torch.arange(W)[None, None, :]
    tokens = base + 100 * row + 10 * slot + j
    logprobs = (-(j + 1).double() / 10.0).expand(n, K, W)
    return BlockProposal(tokens, logprobs, None if buckets is None else torch.tensor(buckets))


def test_bucket_maps_give_paper_widths():
    buckets = torch.tensor([[0, 1, 2, 3]])
    assert branch_widths(buckets).tolist() == [[2, 4, 10, 0]]
    assert branch_widths(buckets, BUCKET_MAP_FALLBACK).tolist() == [[2, 4, 6, 4]]
    with pytest.raises(ValueError, match="4 widths"):
        branch_widths(buckets, (2, 4, 10))


def test_first_block_hand_built():
    tree = DraftTree.rooted_at(7)
    starts = expand_blocks(tree, [Start(0)], proposal([[0, 1, 0]]))
    # slot 0: 2 siblings under the root; slot 1: 4 under slot 0's top-1; slot 2: 2 under slot 1's
    assert tree.tokens == [7, 100, 101, 110, 111, 112, 113, 120, 121]
    assert tree.parents == [-1, 0, 0, 1, 1, 1, 1, 3, 3]
    assert tree.depth == [0, 1, 1, 2, 2, 2, 2, 3, 3]
    # slot 1 is bucket b1: its alternatives start blocks; the full chain's end does too
    assert starts == [
        Start(4, 0, 1, (1,)),
        Start(5, 0, 1, (1,)),
        Start(6, 0, 1, (1,)),
        Start(7, 0, 2, (2,)),
    ]
    assert math.isclose(tree.score[7], -0.1 - 0.1 - 0.1)
    assert math.isclose(tree.score[5], -0.1 - 0.3)


def test_zero_width_stops_the_block():
    tree = DraftTree.rooted_at(7)
    starts = expand_blocks(tree, [Start(0)], proposal([[2, 3, 0]]))
    assert tree.tokens[1:] == list(range(100, 110))  # slot 0 (b2): 10 siblings, then give up
    assert tree.parents[1:] == [0] * 10
    assert [s.node for s in starts] == list(range(2, 11))  # b2 alternatives only, no chain end
    tree = DraftTree.rooted_at(7)
    expand_blocks(tree, [Start(0)], proposal([[2, 3, 0]]), BUCKET_MAP_FALLBACK)
    assert tree.num_nodes == 1 + 6 + 4 + 2


def test_without_rank_head_uses_fixed_width():
    tree = DraftTree.rooted_at(7)
    starts = expand_blocks(tree, [Start(0)], proposal(None), fixed_width=3)
    assert tree.num_nodes == 1 + 3 * K
    assert starts == [Start(7, 0, K - 1, (K - 1,))]


def test_budget_keeps_best_nodes_and_their_ancestors():
    tree = DraftTree.rooted_at(7)
    expand_blocks(tree, [Start(0)], proposal([[0, 1, 0]]))
    pruned, kept = prune_to_budget(tree, 6)
    # scores: 1:-.1 2:-.2 3:-.2 4:-.3 5:-.4 6:-.5 7:-.3 8:-.4 -> best five: 1, 2, 3, 4, 7
    assert kept == [0, 1, 2, 3, 4, 7]
    assert pruned.tokens == [7, 100, 101, 110, 111, 120]
    assert pruned.parents == [-1, 0, 0, 1, 1, 3]
    assert pruned.depth == [0, 1, 1, 2, 2, 3]
    assert prune_to_budget(tree, 100)[0] is tree
    with pytest.raises(ValueError):
        prune_to_budget(tree, 0)


def test_accepted_within_budget_is_the_path_a_pruned_tree_keeps():
    """A path's drafts a smaller budget still holds: those that survive ``prune_to_budget``."""
    tree = DraftTree.rooted_at(7)
    expand_blocks(tree, [Start(0)], proposal([[0, 1, 0]]))
    # best five: 1, 2, 3, 4, 7 (above); path 0-1-3-7 (chain, then its depth-3 node)
    assert accepted_within_budgets(tree, [0, 1, 3, 7], [6])[0] == 3
    assert accepted_within_budgets(tree, [0, 1, 3, 7], [4])[0] == 2  # best three: 1, 2, 3
    assert accepted_within_budgets(tree, [0, 2], [2])[0] == 0  # best one: 1
    assert accepted_within_budgets(tree, [0, 1, 3, 7], [1])[0] == 0
    assert accepted_within_budgets(tree, [0], [8])[0] == 0
    assert accepted_within_budgets(tree, [0, 1, 3, 7], [1, 2, 4, 6, 8]) == [0, 1, 2, 3, 3]
    for budget in range(1, tree.num_nodes + 1):
        pruned, kept = prune_to_budget(tree, budget)
        for node in range(tree.num_nodes):  # every path of the tree: root to ``node``
            path = [node]
            while path[-1] != 0:
                path.append(tree.parents[path[-1]])
            path.reverse()
            within = accepted_within_budgets(tree, path, [budget])[0]
            assert all(n in kept for n in path[: within + 1])
            assert within == len(path) - 1 or path[within + 1] not in kept


def test_grow_tree_runs_m_blocks_from_selected_starts():
    calls: list[list[Start]] = []

    def draft(starts: list[Start]) -> BlockProposal:
        calls.append(list(starts))
        buckets = [[0, 1, 0]] if len(calls) == 1 else [[0, 0, 0]] * len(starts)
        return proposal(buckets, base=1000 * len(calls))

    tree = grow_tree(draft, root_token=7, num_blocks=2, max_nodes=200, max_starts=2)
    assert len(calls) == 2
    # round 2 starts: the two best candidates, chain end (score -.3) then alternative node 4 (-.3)
    assert [(s.node, s.row, s.slot) for s in calls[1]] == [(4, 0, 1), (7, 0, 2)]
    assert tree.num_nodes == 9 + 2 * 2 * K
    assert max(tree.depth) == 2 * K  # M blocks reach depth M*K
    budget = grow_tree(draft, root_token=7, num_blocks=2, max_nodes=12, max_starts=2)
    assert budget.num_nodes == 12
    assert ancestor_mask(budget.parents).sum(-1).tolist() == [d + 1 for d in budget.depth]


def small_tree() -> DraftTree:
    """root 0 -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 3 -> {6}; 5 -> {7}."""
    tree = DraftTree.rooted_at(50)
    for token, parent in [(10, 0), (11, 0), (20, 1), (21, 1), (22, 2), (30, 3), (31, 5)]:
        tree.add(token, parent, -0.5)
    return tree


def test_mask_rows_are_ancestors():
    tree = small_tree()
    mask = build_verify_input(tree, seq_len=9).tree_mask
    for i in range(tree.num_nodes):
        ancestors, node = {i}, i
        while tree.parents[node] >= 0:
            node = tree.parents[node]
            ancestors.add(node)
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == ancestors
    with pytest.raises(ValueError, match="precede"):
        ancestor_mask([-1, 2, 0])


def test_retrieve_arrays_follow_parent_list_and_sglang_convention():
    tree = small_tree()
    vi = build_verify_input(tree, seq_len=9, flat_offset=16)
    assert vi.retrieve_index.tolist() == list(range(16, 24))
    assert vi.retrieve_next_token.tolist() == [1, 3, 5, 6, -1, 7, -1, -1]
    assert vi.retrieve_next_sibling.tolist() == [-1, 2, -1, 4, -1, -1, -1, -1]
    assert vi.positions.tolist() == [9, 10, 10, 11, 11, 11, 12, 12]
    assert vi.draft_tokens.tolist() == tree.tokens
    parents = vi.parents[None]
    first, sibling = first_child_and_next_sibling(
        parents, torch.ones_like(parents, dtype=torch.bool)
    )
    assert torch.equal(first[0], vi.retrieve_next_token)
    assert torch.equal(sibling[0], vi.retrieve_next_sibling)


def test_greedy_walk_on_constructed_predictions():
    tree = small_tree()
    vi = build_verify_input(tree, seq_len=0)
    # target argmax after each node: root->11 (node 2), node 2->22 (node 5), node 5->31 (node 7)
    target = [11, 99, 22, 99, 99, 31, 99, 42]
    path, bonus = greedy_verify_walk(tree.tokens, tree.parents, target)
    assert path == [0, 2, 5, 7] and bonus == 42
    links = (vi.retrieve_index.tolist(), vi.retrieve_next_token.tolist())
    args = (tree.tokens, *links, vi.retrieve_next_sibling.tolist(), target)
    assert accept_greedy_path(*args, max_steps=10) == path
    # nothing matches: only the root, bonus = target at the root
    assert greedy_verify_walk(tree.tokens, tree.parents, [12] * 8) == ([0], 12)
    # partial: root->10 (node 1), node 1->21 (node 4, a leaf)
    path, bonus = greedy_verify_walk(tree.tokens, tree.parents, [10, 21, 0, 0, 7, 0, 0, 0])
    assert path == [0, 1, 4] and bonus == 7


def test_greedy_walk_prefers_longest_path_among_equal_tokens():
    tree = DraftTree.rooted_at(1)
    for token, parent in [(5, 0), (5, 0), (6, 2)]:
        tree.add(token, parent, -0.1)
    path, bonus = greedy_verify_walk(tree.tokens, tree.parents, [5, 0, 6, 8])
    assert path == [0, 2, 3] and bonus == 8


def test_propose_from_logits_maps_draft_ids():
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]] * K])  # [1, K, 4]
    d2t = torch.tensor([40, 41, 42, 43])
    rank = torch.zeros(1, K, 4)
    rank[..., 2] = 1.0
    prop = propose_from_logits(logits, d2t, rank, max_width=3)
    assert prop.top_tokens[0, 0].tolist() == [41, 43, 42]
    assert prop.buckets.tolist() == [[2] * K]
    top3_mass = 1 - 1 / sum(math.exp(x) for x in (0.0, 3.0, 1.0, 2.0))
    torch.testing.assert_close(prop.top_logprobs.exp().sum(-1), torch.full((1, K), top3_mass))
