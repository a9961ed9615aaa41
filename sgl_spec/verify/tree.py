"""A draft tree, shared by every algorithm that verifies trees or chains (a chain is a tree with
one child per node); ``verify/packing.pack_trees`` flattens a batch of them into the inputs of
a tree-verify forward.

Node 0 is the root (the last verified token); parents precede children. The verifier inputs
follow SGLang's convention (``sglang/kernels/ops/speculative/spec_tree.py``):
``retrieve_index[i] = flat_offset + i``, ``retrieve_next_token`` = first (lowest-index) child,
``retrieve_next_sibling`` = next higher-index child of the same parent, -1 for none;
``positions = seq_len + depth``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
