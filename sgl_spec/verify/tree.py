"""A draft tree and its flattening into the inputs of a tree-verify forward, shared by every
algorithm that verifies trees or chains (a chain is a tree with one child per node).

Node 0 is the root (the last verified token); parents precede children. The verifier inputs
follow SGLang's convention (``sglang/kernels/ops/speculative/spec_tree.py``):
``retrieve_index[i] = flat_offset + i``, ``retrieve_next_token`` = first (lowest-index) child,
``retrieve_next_sibling`` = next higher-index child of the same parent, -1 for none;
``positions = seq_len + depth``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Growing candidate tree; node 0 is the root (last verified token), parent index -1."""

    tokens: list[int]
    parents: list[int]
    depth: list[int]
    score: list[float]  # cumulative draft log-probability along the path (root 0)

    @classmethod
    def rooted_at(cls, token: int) -> DraftTree:
        return cls([int(token)], [-1], [0], [0.0])

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> DraftTree:
        """``root`` followed by ``drafts``, one child each (draft log-probabilities unknown)."""
        tree = cls.rooted_at(root)
        for parent, token in enumerate(drafts):
            tree.add(int(token), parent, 0.0)
        return tree

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, logprob: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(self.score[parent] + float(logprob))
        return self.num_nodes - 1


@dataclass
class TreeVerifyInput:
    """Everything the target's tree-verify forward needs for one request."""

    draft_tokens: torch.Tensor  # [n] token of each node, root first
    parents: torch.Tensor  # [n] parent node, -1 for the root
    positions: torch.Tensor  # [n] seq_len + depth
    tree_mask: torch.Tensor  # [n, n] bool, row i: node i and its ancestors
    retrieve_index: torch.Tensor  # [n] flat_offset + i
    retrieve_next_token: torch.Tensor  # [n] first child, -1 for none
    retrieve_next_sibling: torch.Tensor  # [n] next sibling, -1 for none


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:  # [n, n] bool
    """Row ``i`` marks node ``i`` and all its ancestors; parents must precede children."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            if parent >= i:
                raise ValueError(f"node {i} has parent {parent}: parents must precede children")
            mask[i] |= mask[parent]
    return mask


def build_verify_input(tree: DraftTree, seq_len: int, flat_offset: int = 0) -> TreeVerifyInput:
    """Flatten ``tree`` into the verifier's inputs (SGLang convention, see module docstring)."""
    n = tree.num_nodes
    next_token = [-1] * n
    next_sibling = [-1] * n
    last_child = [-1] * n
    for i in range(1, n):
        parent = tree.parents[i]
        if last_child[parent] == -1:
            next_token[parent] = i
        else:
            next_sibling[last_child[parent]] = i
        last_child[parent] = i
    return TreeVerifyInput(
        draft_tokens=torch.tensor(tree.tokens, dtype=torch.long),
        parents=torch.tensor(tree.parents, dtype=torch.long),
        positions=seq_len + torch.tensor(tree.depth, dtype=torch.long),
        tree_mask=ancestor_mask(tree.parents),
        retrieve_index=flat_offset + torch.arange(n, dtype=torch.long),
        retrieve_next_token=torch.tensor(next_token, dtype=torch.long),
        retrieve_next_sibling=torch.tensor(next_sibling, dtype=torch.long),
    )
