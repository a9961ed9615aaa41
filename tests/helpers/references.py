"""Reference versions the tests check the served code against: plain loops that state a
definition (SpecBlock's Algorithm 2 tree growth, greedy tree verification, one tree's verify
input, MTP's positions and per-request tree mask), kept out of the package because nothing
serving calls them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sgl_spec.mtp.layout import MaskFormat, MtpLayout, _mask_format
from sgl_spec.specblock.tree import (
    BUCKET_MAP_DEFAULT,
    DEFAULT_START_BUCKETS,
    BlockProposal,
    Start,
    expand_blocks,
    prune_to_budget,
)
from sgl_spec.verify.tree import DraftTree


def grow_tree(
    draft: Callable[[list[Start]], BlockProposal],
    root_token: int,
    num_blocks: int,
    max_nodes: int,
    bucket_map: Sequence[int] = BUCKET_MAP_DEFAULT,
    max_starts: int = 8,
    fixed_width: int = 2,
    start_buckets: Sequence[int] = DEFAULT_START_BUCKETS,
) -> DraftTree:
    """Algorithm 2, lines 2-10: up to ``num_blocks`` (M) batched drafter calls, then the budget.

    ``draft(starts)`` runs one batched drafter forward for the given starts (the first call
    gets the single root start and uses the target's features). Each round keeps the
    ``max_starts`` best-scoring candidate starts; growth stops early once the tree holds
    ``max_nodes`` nodes or no start is left.
    """
    tree = DraftTree.rooted_at(root_token)
    starts = [Start(0)]
    for _ in range(num_blocks):
        if not starts or tree.num_nodes >= max_nodes:
            break
        proposal = draft(starts)
        candidates = expand_blocks(tree, starts, proposal, bucket_map, fixed_width, start_buckets)
        candidates.sort(key=lambda s: (-tree.score[s.node], s.node))
        starts = candidates[:max_starts]
    return prune_to_budget(tree, max_nodes)[0]


def greedy_verify_walk(
    tokens: Sequence[int],  # [n] token of each node
    parents: Sequence[int],  # [n]
    target_predict: Sequence[int],  # [n] target argmax after each node
) -> tuple[list[int], int]:
    """Reference greedy tree verification: the longest root path whose every draft token equals
    the target's argmax at its parent. Returns the path's nodes (root first) and the bonus
    token (the target's argmax at the path's last node); acceptance length = len(path)."""
    children: list[list[int]] = [[] for _ in tokens]
    for i, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(i)

    def longest(node: int) -> list[int]:
        best: list[int] = []
        for child in children[node]:
            if tokens[child] == target_predict[node]:
                path = longest(child)
                if len(path) > len(best):
                    best = path
        return [node, *best]

    path = longest(0)
    return path, int(target_predict[path[-1]])


def build_positions(
    seq_lens: torch.Tensor,  # [bs] committed KV length; anchor 0 sits at position seq_len
    layout: MtpLayout,
) -> torch.Tensor:  # [bs, W]
    return seq_lens.long()[:, None] + layout.position_offsets.to(seq_lens.device)[None, :]


def tree_mask_reference(
    layout: MtpLayout,
    bs: int,
    mode: MaskFormat | int | str,
    seq_lens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-request loop version of :func:`tree_mask` (the definition it is tested against)."""
    fmt, w, vis = _mask_format(mode), layout.width, layout.visibility
    parts = []
    for b in range(bs):
        if fmt == MaskFormat.QLEN_ONLY:
            parts.append(vis.reshape(-1))
        else:
            prefix = torch.ones(w, int(seq_lens[b]), dtype=torch.bool)
            parts.append(torch.cat([prefix, vis], dim=1).reshape(-1))
    return torch.cat(parts)


@dataclass
class TreeVerifyInput:
    """Everything the target's tree-verify forward needs for one request (what
    ``verify/packing.pack_trees`` packs per tree, padded, for a batch)."""

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
