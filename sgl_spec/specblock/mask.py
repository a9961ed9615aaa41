"""The drafter's attention mask (paper App. A.2, Figure 3).

A block forward attends to three sources:

1. the verified prefix: the K keys/values every previously committed position produced in its
   own draft forward, all visible;
2. blocks drafted earlier in this verifier iteration, only along the branch path: a block that
   starts from slot ``j`` of a preceding block sees that block's slots ``0..j`` and not the rest;
3. itself, causally: slot ``k`` sees slots ``<= k`` of its own block.

Keys of sources 1-2 are passed to the drafter as cached context ahead of the block's own keys,
so a mask row is ``[context columns | block columns]``.
"""

from __future__ import annotations

import torch

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: ([bs, n_kv, C, hd], same)


def block_attention_mask(
    block_size: int,
    num_starts: int = 1,
    num_context: int = 0,
    context_visible: torch.Tensor | None = None,  # [C] or [bs, C] bool
    device: torch.device | None = None,
) -> torch.Tensor:  # [S*K, C + S*K], or [bs, S*K, C + S*K] with a batched context_visible
    """Boolean mask (True = may attend) of one drafter forward over ``S`` starts of K slots.

    Within a block the mask is causal (App. A.2, source 3). With ``S > 1`` the starts are
    consecutive committed positions (the training layout): a later start sees every slot of an
    earlier start's block, as the verified prefix does at inference (source 1). Context columns
    follow ``context_visible`` (all visible when omitted).
    """
    k, s = block_size, num_starts
    query_start = torch.arange(s * k, device=device) // k
    query_slot = torch.arange(s * k, device=device) % k
    earlier = query_start[None, :] < query_start[:, None]
    same = query_start[None, :] == query_start[:, None]
    block = earlier | (same & (query_slot[None, :] <= query_slot[:, None]))  # [S*K, S*K]
    if context_visible is None:
        context_visible = torch.ones(num_context, dtype=torch.bool, device=device)
    if context_visible.shape[-1] != num_context:
        raise ValueError(
            f"context_visible has {context_visible.shape[-1]} columns, not {num_context}"
        )
    context = context_visible.to(device=block.device, dtype=torch.bool)
    if context.dim() == 1:
        return torch.cat([context.expand(s * k, num_context), block], dim=-1)
    bs = context.shape[0]
    context = context[:, None, :].expand(bs, s * k, num_context)
    return torch.cat([context, block.expand(bs, s * k, s * k)], dim=-1)


def cross_block_visibility(
    num_prefix: int,
    block_size: int,
    path_slots: list[int],
    device: torch.device | None = None,
) -> torch.Tensor:  # [num_prefix + len(path_slots) * K] bool
    """Visible context columns of a block started along a branch (App. A.2, Figure 3).

    The context is laid out as ``[prefix keys | block 1's K keys | block 2's K keys | ...]`` for
    the blocks on the path to the new start; ``path_slots[m]`` is the 0-based slot of block
    ``m`` that the path leaves it from, so slots ``0..path_slots[m]`` are on-path and visible.
    Figure 3: block 2 branching from ``B_{1,1}`` sees ``B_{1,0}, B_{1,1}`` but not
    ``B_{1,2}, B_{1,3}``.
    """
    for j in path_slots:
        if not 0 <= j < block_size:
            raise ValueError(f"path slot {j} outside a block of {block_size}")
    slot = torch.arange(block_size, device=device)
    parts = [torch.ones(num_prefix, dtype=torch.bool, device=device)]
    parts += [slot <= j for j in path_slots]
    return torch.cat(parts)
