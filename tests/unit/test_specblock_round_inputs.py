"""A tree round's inputs and mask (``drafting._round_inputs`` / ``_tree_round_mask``), built in
a few tensor ops, against the per-start definitions written out cell by cell: the start node's
token and depth, the state it continues from (the root's for a first block, the last round's
``h^(L)`` at its row and slot otherwise, zeros for padding), and visibility of the prefix, of
the on-path slots ``0..slot`` of each earlier round's block, and of its own block causally --
none of the context for a padding start."""

from __future__ import annotations

import torch

from sgl_spec.specblock.drafting import _Round, _round_inputs, _tree_round_mask
from sgl_spec.specblock.tree import Start
from sgl_spec.verify.tree import DraftTree

K, D = 3, 5


def _trees() -> list[DraftTree]:
    trees = [DraftTree.rooted_at(7), DraftTree.rooted_at(9)]
    for tree, tokens in zip(trees, ([11, 12, 13, 14], [21, 22]), strict=True):
        for i, token in enumerate(tokens):
            tree.add(token, 0 if i < 2 else i - 1, -0.5)
    return trees


def _rounds() -> list[_Round]:
    """Round 0: one block per request from the root; round 1: request 0 two starts, request 1
    one (the second of its row is padding)."""
    gen = torch.Generator().manual_seed(0)
    first = _Round([[Start(0)], [Start(0)]], 1, [], torch.randn(2, 1, K, D, generator=gen))
    second_starts = [[Start(1, 0, 0), Start(2, 0, 2)], [Start(1, 0, 1)]]
    second = _Round(second_starts, 2, [], torch.randn(2, 2, K, D, generator=gen))
    return [first, second]


def _reference_mask(prefix, rounds, starts, width):
    bs, c = prefix.shape
    offsets = [c]
    for r in rounds:
        offsets.append(offsets[-1] + r.width * K)
    cols = offsets[-1]
    mask = torch.zeros(bs, width * K, cols + width * K, dtype=torch.bool)
    for b in range(bs):
        for i in range(width):
            for j in range(K):
                q = i * K + j
                mask[b, q, cols + i * K : cols + i * K + j + 1] = True  # own block, causal
                if i >= len(starts[b]):
                    continue
                mask[b, q, :c] = prefix[b]
                start, path = starts[b][i], []
                for r in range(len(rounds) - 1, -1, -1):  # the block it leaves in each round
                    path.append((r, start.row, start.slot))
                    start = rounds[r].starts[b][start.row]
                for r, row, slot in path:
                    first = offsets[r] + row * K
                    mask[b, q, first : first + slot + 1] = True
    return mask


def test_round_mask_and_inputs_match_the_per_start_definitions():
    trees, rounds = _trees(), _rounds()
    prefix = torch.tensor([[True, True, True, False], [True, True, False, False]])
    root_cond = torch.randn(2, D)
    for used in (0, 1, 2):  # after no round, one round, two rounds
        done = rounds[:used]
        if used == 0:
            starts, width = [[Start(0)], [Start(0)]], 1
        else:  # two starts for request 0 (one leaving through slot 2), one for request 1
            starts = [[Start(3, 0, 2), Start(4, 1, 0)], [Start(2, 0, 1)]]
            width = 2
            if used == 1:
                starts = [[Start(3, 0, 2)], [Start(2, 0, 0), Start(1, 0, 1)]]
        got = _tree_round_mask(prefix, done, starts, width, K)
        assert torch.equal(got, _reference_mask(prefix, done, starts, width))
        cond, ids, pos = _round_inputs(trees, starts, width, [40, 60], root_cond, done)
        for b in range(2):
            for i in range(width):
                if i >= len(starts[b]):
                    assert ids[b, i] == 0 and pos[b, i] == 0 and not cond[b, i].any()
                    continue
                start = starts[b][i]
                assert ids[b, i] == trees[b].tokens[start.node]
                assert pos[b, i] == [40, 60][b] + trees[b].depth[start.node]
                want = root_cond[b] if start.row < 0 else done[-1].hidden[b, start.row, start.slot]
                assert torch.equal(cond[b, i], want)
