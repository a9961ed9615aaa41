"""Pack a batch of draft trees (SpecBlock trees, MineDraft chains) into one target-verify input
(SpecBlock paper App. A.2 / Alg. 2 line 11) and index a drafter KV pool's context. Pure
functions of trees and lengths.

SGLang's target-verify forward takes the same number of tokens per request, so every tree is
padded to ``width`` nodes. A padding node has token 0, sits at the root's position, sees only
the prefix and itself, and is linked into no tree (``retrieve_next_token`` /
``retrieve_next_sibling`` never reach it), so verification never accepts it; its KV lands in
the step's reserved slots past the committed length and is overwritten later.

Mask formats follow SGLang's ``TreeMaskMode`` (``QLEN_ONLY`` for the CPU kernel: per request
the ``[width, width]`` node block; ``FULL_MASK`` for GPU kernels: per request
``[width, seq_len + width]`` with the prefix columns set), flattened and concatenated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sgl_spec.verify.tree import DraftTree

QLEN_ONLY = 1
FULL_MASK = 0


@dataclass
class PackedTrees:
    """One verify batch of ``bs`` trees padded to ``width`` nodes each."""

    draft_tokens: torch.Tensor  # [bs * width] root first in each row
    positions: torch.Tensor  # [bs * width] seq_len + depth
    custom_mask: torch.Tensor  # flat bool in the requested format
    retrieve_index: torch.Tensor  # [bs, width] flat node index b * width + i
    retrieve_next_token: torch.Tensor  # [bs, width] first child, -1 for none
    retrieve_next_sibling: torch.Tensor  # [bs, width] next sibling, -1 for none
    num_nodes: list[int]  # real nodes per tree
    width: int
    max_depth: int  # deepest real node (root depth 0)


def pack_trees(
    trees: Sequence[DraftTree],
    seq_lens: Sequence[int],  # [bs] committed length; the root sits at position seq_len
    width: int,
    mask_format: int = QLEN_ONLY,
) -> PackedTrees:
    """Flatten, pad and concatenate ``trees`` (see module docstring). Built in Python lists and
    converted once per field: per-node tensor ops cost ~0.4 ms a tree on a CPU host."""
    if mask_format not in (QLEN_ONLY, FULL_MASK):
        raise ValueError(f"unsupported tree mask format {mask_format}")
    tokens: list[int] = []
    positions: list[int] = []
    next_token: list[int] = []
    next_sibling: list[int] = []
    ancestors: list[int] = []  # per node a bit set: itself and its ancestors
    num_nodes, max_depth = [], 0
    for b, (tree, seq_len) in enumerate(zip(trees, seq_lens, strict=True)):
        n = tree.num_nodes
        if n > width:
            raise ValueError(f"tree {b} has {n} nodes, more than the verify width {width}")
        tokens += tree.tokens
        tokens += [0] * (width - n)
        positions += [int(seq_len) + d for d in tree.depth]
        positions += [int(seq_len)] * (width - n)
        _link_tree(tree.parents, width, next_token, next_sibling, ancestors)
        num_nodes.append(n)
        max_depth = max(max_depth, max(tree.depth))
    bs = len(num_nodes)
    mask = _bit_rows(ancestors, width).view(bs, width, width)
    if mask_format == QLEN_ONLY:
        custom_mask = mask.reshape(-1)
    else:  # FULL_MASK: each request's prefix columns before its node block
        rows = [
            torch.cat([torch.ones(width, int(seq_len), dtype=torch.bool), mask[b]], 1).reshape(-1)
            for b, seq_len in enumerate(seq_lens)
        ]
        custom_mask = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)
    return PackedTrees(
        draft_tokens=torch.tensor(tokens, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        custom_mask=custom_mask,
        retrieve_index=torch.arange(bs * width, dtype=torch.long).view(bs, width),
        retrieve_next_token=torch.tensor(next_token, dtype=torch.long).view(bs, width),
        retrieve_next_sibling=torch.tensor(next_sibling, dtype=torch.long).view(bs, width),
        num_nodes=num_nodes,
        width=width,
        max_depth=max_depth,
    )


def _link_tree(
    parents: Sequence[int],
    width: int,
    next_token: list[int],  # appended: first child per node, -1 for none
    next_sibling: list[int],  # appended: next sibling per node, -1 for none
    ancestors: list[int],  # appended: per node a bit set of itself and its ancestors
) -> None:
    """One tree's links and ancestor sets, padded to ``width`` (padding sees only itself)."""
    first, last_child = len(next_token), [-1] * len(parents)
    next_token += [-1] * width
    next_sibling += [-1] * width
    for i, parent in enumerate(parents):
        if parent < 0:
            ancestors.append(1 << i)
            continue
        if parent >= i:
            raise ValueError(f"node {i} has parent {parent}: parents must precede children")
        ancestors.append(ancestors[first + parent] | (1 << i))
        if last_child[parent] == -1:
            next_token[first + parent] = i
        else:
            next_sibling[first + last_child[parent]] = i
        last_child[parent] = i
    ancestors += [1 << i for i in range(len(parents), width)]


def _bit_rows(bits: list[int], width: int) -> torch.Tensor:  # [len(bits), width] bool
    """Bit ``j`` of each int as column ``j`` (any width: through little-endian bytes)."""
    nbytes = (width + 7) // 8
    raw = b"".join(row.to_bytes(nbytes, "little") for row in bits)
    unpacked = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    return torch.from_numpy(unpacked.reshape(len(bits), nbytes * 8)[:, :width].astype(bool))


def accepted_path(
    accept_index: torch.Tensor,  # [bs, D+1] flat node index of each accepted node, -1 padded
    width: int,
) -> list[list[int]]:
    """Per request, the accepted nodes (root first) as indices into its own tree."""
    rows = accept_index.to(torch.long).cpu().tolist()
    return [[i - b * width for i in row if i >= 0] for b, row in enumerate(rows)]


def context_visibility(
    num_tokens: torch.Tensor,  # [bs] committed tokens with drafter context
    max_tokens: int,
    block_size: int,
    last_slot_only: bool,
) -> torch.Tensor:  # [bs, max_tokens * K] bool
    """Which cached drafter keys a forward sees: every slot of each committed position's block;
    with ``last_slot_only`` only slot 1 of the last position's block, the cut ``s = 1`` of a
    cross-block start from it (``drafting`` module docstring)."""
    t = torch.arange(max_tokens, device=num_tokens.device)
    n = num_tokens.to(torch.long)[:, None, None]
    valid = (t[None, :, None] < n).expand(-1, -1, block_size).clone()
    if last_slot_only:
        slot = torch.arange(block_size, device=num_tokens.device)
        last = t[None, :, None] == n - 1
        valid &= ~(last & (slot[None, None, :] > 0))
    return valid.reshape(num_tokens.shape[0], max_tokens * block_size)
