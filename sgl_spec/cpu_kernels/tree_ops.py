"""Draft-tree ops: build the EAGLE token tree, verify it greedily, rebuild it from an n-gram mask.

One request's tree has ``n = draft_token_num`` nodes. Node 0 is the root (the last verified
token, the "bonus" of the previous round); nodes ``1..n-1`` are the draft tokens that
``organize_draft_results`` selected, in increasing flat score index, so a parent precedes its
children (EAGLE-2, Li et al. 2024, sec. 4: the tree is re-ranked and the top ``n-1`` kept).
The retrieval links are per node: ``retrive_index[b, i] = b*n + i`` (flat id into the
verify batch), ``retrive_next_token`` = first child, ``retrive_next_sibling`` = next sibling
with the same parent, -1 for none. ``positions`` = committed length + depth in the tree.
Each op writes its outputs in place, as ``sglang.kernels.jit.csrc.speculative.tree`` does;
the link outputs of ``build_tree_kernel_efficient_cpu`` are written in full (-1 where the
kernel relies on the caller's -1 fill).
"""

from __future__ import annotations

import torch

from sgl_spec.cpu_kernels.opdef import OpDef

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def draft_tree_parents(
    parent_list: torch.Tensor,  # [bs, topk*(depth-1)+1] flat token index of each row's parent
    selected_index: torch.Tensor,  # [bs, n-1] flat score index of each selected draft token
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parent node of each tree node and whether that parent was found among the selected.

    A draft token at flat score index ``s`` was expanded from score row ``s // topk``; row 0
    is the root, row ``r > 0`` is the token ``parent_list[b, r]``, found by value among
    ``selected_index``. A parent that was not selected (a NaN logprob upstream) leaves the
    node unlinked; its mask then stops at the node, as in the Triton kernel.
    """
    bs, num_selected = selected_index.shape
    parents = torch.zeros(bs, num_selected + 1, dtype=torch.long)
    found = torch.ones(bs, num_selected + 1, dtype=torch.bool)
    parents[:, 0] = -1
    if num_selected == 0:
        return parents, found
    selected = selected_index.long()
    parent_row = selected // topk  # [bs, n-1]
    if parent_list.shape[1] > 0:
        rows = parent_row.clamp(0, parent_list.shape[1] - 1)
        parent_token = parent_list.long().gather(1, rows)  # [bs, n-1]
    else:
        parent_token = torch.full_like(selected, -1)
    match = selected[:, None, :] == parent_token[:, :, None]  # [bs, child, candidate]
    has_match = match.any(-1)
    first_match = match.to(torch.uint8).argmax(-1) + 1
    at_root = parent_row == 0
    parents[:, 1:] = torch.where(at_root, 0, first_match)
    found[:, 1:] = at_root | has_match
    return parents, found


def ancestor_mask(parents: torch.Tensor, found: torch.Tensor, depth: int) -> torch.Tensor:
    """``mask[b, i, j]``: node ``j`` is node ``i``, an ancestor of it, or the root.

    Follows parents at most ``depth - 1`` levels up (a valid tree is at most ``depth`` deep).
    """
    bs, n = parents.shape
    up = torch.where(found & (parents >= 0), parents, 0)  # unlinked nodes stop at the root
    base = torch.eye(n, dtype=torch.bool).expand(bs, n, n).clone()
    base[:, :, 0] = True
    mask = base.clone()
    gather_index = up[:, :, None].expand(bs, n, n)
    for _ in range(max(depth - 1, 0)):
        mask = base | mask.gather(1, gather_index)
    return mask


def first_child_and_next_sibling(
    parents: torch.Tensor, linked: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest child of each node and the next larger sibling of each node; -1 for none."""
    bs, n = parents.shape
    node = torch.arange(n)
    linked_parent = torch.where(linked & (parents >= 0), parents, -1)  # [bs, n]
    is_child = linked_parent[:, None, :] == node[None, :, None]  # [bs, node, candidate]
    first_child = torch.where(is_child, node, n).amin(-1)
    same_parent = linked_parent[:, :, None] == linked_parent[:, None, :]
    later = node[None, :] > node[:, None]  # [node, candidate]
    sibling = same_parent & later & (linked_parent >= 0)[:, :, None]
    next_sibling = torch.where(sibling, node, n).amin(-1)
    first_child = torch.where(first_child < n, first_child, -1)
    next_sibling = torch.where(next_sibling < n, next_sibling, -1)
    return first_child, next_sibling


def _write_tree_mask(
    tree_mask: torch.Tensor,  # flat, layout chosen by mode
    mask: torch.Tensor,  # [bs, n, n] bool
    seq_lens: list[int],
    mode: int,
) -> None:
    bs, n, _ = mask.shape
    flat = tree_mask.view(-1)
    if mode == QLEN_ONLY:
        flat[: bs * n * n].copy_(mask.reshape(-1))
    elif mode == FULL_MASK:
        # per request: n rows of [seq_len prefix columns | n tree columns]; prefix left as is
        offset = 0
        for b, seq_len in enumerate(seq_lens):
            rows = flat[offset : offset + n * (seq_len + n)].view(n, seq_len + n)
            rows[:, seq_len:].copy_(mask[b])
            offset += n * (seq_len + n)
    elif mode == QLEN_ONLY_BITPACKING:
        if n > 32:
            raise ValueError(f"QLEN_ONLY_BITPACKING supports at most 32 draft tokens, got {n}")
        num_bytes = 4 if n > 16 else (2 if n > 8 else 1)
        bits = (mask.long() << torch.arange(n)).sum(-1)  # [bs, n], bit j = column j
        shifts = 8 * torch.arange(num_bytes)
        packed = ((bits[..., None] >> shifts) & 0xFF).to(torch.uint8)
        flat.view(torch.uint8)[: bs * n * num_bytes].copy_(packed.reshape(-1))
    else:
        raise ValueError(f"tree_mask_mode must be 0, 1 or 2, got {mode}")


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,  # [bs, topk*(depth-1)+1]
    selected_index: torch.Tensor,  # [bs, n-1]
    verified_seq_len: torch.Tensor,  # [bs]
    tree_mask: torch.Tensor,  # out: QLEN_ONLY [bs*n*n], FULL_MASK [sum(seq)*n + bs*n*n]
    positions: torch.Tensor,  # out: [bs*n]
    retrive_index: torch.Tensor,  # out: [bs, n]
    retrive_next_token: torch.Tensor,  # out: [bs, n]
    retrive_next_sibling: torch.Tensor,  # out: [bs, n]
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    bs, n = verified_seq_len.shape[0], draft_token_num
    if bs == 0:
        return
    parents, found = draft_tree_parents(parent_list, selected_index[:, : n - 1], topk)
    mask = ancestor_mask(parents, found, depth)
    first_child, next_sibling = first_child_and_next_sibling(parents, found)
    seq_lens = verified_seq_len.long()
    positions.view(-1)[: bs * n].copy_((seq_lens[:, None] + mask.sum(-1) - 1).reshape(-1))
    retrive_index.copy_(torch.arange(bs * n).view(bs, n))
    retrive_next_token.copy_(first_child)
    retrive_next_sibling.copy_(next_sibling)
    _write_tree_mask(tree_mask, mask, seq_lens.tolist(), int(tree_mask_mode))


def accept_greedy_path(
    candidates: list[int],  # [n] draft token of each node
    retrive_index: list[int],  # [n]
    next_token: list[int],  # [n]
    next_sibling: list[int],  # [n]
    target_predict: list[int],  # [bs*n] target argmax at each flat node
    max_steps: int,
) -> list[int]:
    """Flat ids of the accepted path, root first: at each accepted node take the first child
    whose draft token equals the target's argmax there (greedy tree verification)."""
    path = [retrive_index[0]]
    node = 0
    for _ in range(1, max_steps):
        node = next_token[node]
        while node != -1 and candidates[node] != target_predict[path[-1]]:
            node = next_sibling[node]
        if node == -1:
            break
        path.append(retrive_index[node])
    return path


def verify_tree_greedy(
    predicts: torch.Tensor,  # out: [bs*n] int32
    accept_index: torch.Tensor,  # out: [bs, num_spec_step] int32, caller fills -1
    accept_token_num: torch.Tensor,  # out: [bs] int32, accepted drafts (bonus excluded)
    candidates: torch.Tensor,  # [bs, n]
    retrive_index: torch.Tensor,  # [bs, n]
    retrive_next_token: torch.Tensor,  # [bs, n]
    retrive_next_sibling: torch.Tensor,  # [bs, n]
    target_predict: torch.Tensor,  # [bs, n]
) -> None:
    """``predicts`` gets the target token at every accepted node (the last one is the bonus)."""
    bs, num_spec_step = accept_index.shape[0], accept_index.shape[1]
    if bs == 0:
        return
    target = target_predict.reshape(-1).tolist()
    cand, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    flat_path: list[int] = []
    for b in range(bs):
        path = accept_greedy_path(
            cand[b], index[b], next_token[b], next_sibling[b], target, num_spec_step
        )
        accept_index[b, : len(path)] = torch.tensor(path, dtype=accept_index.dtype)
        accept_token_num[b] = len(path) - 1
        flat_path.extend(path)
    accepted = torch.tensor(flat_path, dtype=torch.long)
    predicts.view(-1)[accepted] = target_predict.reshape(-1)[accepted].to(predicts.dtype)


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,  # [bs*n*n] bool, row i marks i's ancestors (and i itself)
    verified_seq_len: torch.Tensor,  # [bs]
    positions: torch.Tensor,  # out: [bs*n]
    retrive_index: torch.Tensor,  # out: [bs, n]
    retrive_next_token: torch.Tensor,  # out: [bs, n]
    retrive_next_sibling: torch.Tensor,  # out: [bs, n]
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Links of an n-gram tree given only its mask: parent = nearest earlier ancestor."""
    bs, n = batch_size, draft_token_num
    if bs == 0:
        return
    mask = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n) != 0
    node = torch.arange(n)
    ancestors = mask & (node[None, :] < node[:, None])  # strict: column j < row i
    depth = ancestors.sum(-1)
    parents = torch.where(ancestors, node, -1).amax(-1)  # [bs, n]
    first_child = torch.where(ancestors, node[:, None], n).amin(1)  # min row per column
    first_child = torch.where(first_child < n, first_child, -1)
    _, next_sibling = first_child_and_next_sibling(parents, parents >= 0)
    positions.view(-1)[: bs * n].copy_((verified_seq_len.long()[:, None] + depth).reshape(-1))
    retrive_index.copy_(torch.arange(bs * n).view(bs, n))
    retrive_next_token.copy_(first_child)
    retrive_next_sibling.copy_(next_sibling)


OPS = [
    OpDef(
        "verify_tree_greedy_cpu",
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
        "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, "
        "Tensor retrive_next_sibling, Tensor target_predict) -> ()",
        verify_tree_greedy,
    ),
    OpDef(
        "build_tree_kernel_efficient_cpu",
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
        "Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index, "
        "Tensor(d!) retrive_next_token, Tensor(e!) retrive_next_sibling, int topk, int depth, "
        "int draft_token_num, int tree_mask_mode) -> ()",
        build_tree_kernel_efficient,
    ),
    OpDef(
        "reconstruct_indices_from_tree_mask_cpu",
        "(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, "
        "Tensor(b!) retrive_index, Tensor(c!) retrive_next_token, "
        "Tensor(d!) retrive_next_sibling, int batch_size, int draft_token_num) -> ()",
        reconstruct_indices_from_tree_mask,
    ),
]
