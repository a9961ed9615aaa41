"""Training layout of SpecBlock block chains over a target-written sequence (paper §3.3, App. A.2).

A sequence ``x`` is a prompt followed by the target's greedy continuation, so the target's
greedy token after any prefix ``x[0..p]`` of the continuation is ``x[p+1]`` itself. One drafter
forward (pass 1) drafts a block from *every* position ``p`` at once, conditioned on the target's
features at ``p`` and the token ``x[p]``; block ``p`` sees the blocks of all earlier positions
(the verified prefix of App. A.2, source 1) and itself causally (``mask.block_attention_mask``).

A *chain* continues the block of a start ``a`` across block boundaries (cross-block training,
§3.3): at each boundary a cut ``s`` in ``1..K`` is drawn, the next block conditions on the
drafter's own last-layer state at slot ``s`` of the previous block and starts at position
``a + s`` with the token there. Block ``m`` of a chain sees the prefix blocks of starts ``< a``,
the on-path slots ``1..s`` of each earlier block of its chain (App. A.2, source 2), and itself
causally; chains never see each other's later blocks. Everything here is pure index/mask math.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # label of a block position past the end of the sequence


def block_labels(
    tokens: torch.Tensor,  # [bs, T] prompt + greedy continuation
    positions: torch.Tensor,  # [bs, C] start position of each block
    block_size: int,
) -> torch.Tensor:  # [bs, C, K] target ids, IGNORE_INDEX past the sequence end
    """Slot ``k`` (0-based) of a block started at ``p`` predicts ``x[p + 1 + k]``."""
    t = tokens.shape[1]
    index = positions[..., None] + 1 + torch.arange(block_size, device=tokens.device)
    inside = index < t
    picked = tokens.gather(1, index.clamp(max=t - 1).flatten(1)).view(index.shape)
    return torch.where(inside, picked, IGNORE_INDEX)


def chain_offsets(
    cuts: torch.Tensor,  # [bs, C, M-1] 1-based cut at each block boundary
) -> torch.Tensor:  # [bs, C, M] offset of block m's start from the chain start (0 for block 1)
    """Block ``m`` of a chain starts ``s_1 + ... + s_{m-1}`` positions after the chain start."""
    zero = torch.zeros(*cuts.shape[:-1], 1, dtype=cuts.dtype, device=cuts.device)
    return torch.cat([zero, cuts.cumsum(-1)], dim=-1)


def sample_cuts(
    batch_size: int,
    num_chains: int,
    num_blocks: int,
    block_size: int,
    generator: torch.Generator,
) -> torch.Tensor:  # [bs, C, M-1] uniform in 1..K
    """§3.3: a cut ``s`` drawn uniformly from ``{1, ..., K}`` at every block boundary."""
    shape = (batch_size, num_chains, num_blocks - 1)
    return torch.randint(1, block_size + 1, shape, generator=generator)


def own_block_mask(
    block_size: int,
    num_chains: int,
    device: torch.device | None = None,
) -> torch.Tensor:  # [C*K, C*K] bool
    """Later blocks of different chains are independent: causal inside each chain's block only."""
    index = torch.arange(num_chains * block_size, device=device)
    chain, slot = index // block_size, index % block_size
    return (chain[None, :] == chain[:, None]) & (slot[None, :] <= slot[:, None])


def chain_attention_mask(
    block_size: int,
    num_starts: int,
    chain_starts: torch.Tensor,  # [C] pass-1 start index (= position) of each chain
    cuts: torch.Tensor,  # [bs, C, m-1] cuts of the boundaries before block m (m >= 2)
) -> torch.Tensor:  # [bs, C*K, S*K + (m-1)*C*K] bool, True = may attend
    """Mask of block ``m`` of every chain over ``[pass 1 | blocks 2..m-1 | block m]`` keys.

    Pass 1 holds ``S = num_starts`` blocks (one per position); blocks ``2..m`` hold one block per
    chain. A query of chain ``c`` (start ``a``) sees: every slot of the pass-1 blocks of starts
    ``< a``; slots ``< s_1`` of the block of ``a`` (its on-path slots ``1..s_1``); slots
    ``< s_p`` of its own block ``p`` for ``2 <= p < m``; and its own block ``m`` causally.
    """
    k = block_size
    bs, c, num_prev = cuts.shape
    if num_prev < 1:
        raise ValueError("chain_attention_mask is for blocks m >= 2 (at least one cut)")
    device = cuts.device
    slot = torch.arange(k, device=device)
    start = torch.arange(num_starts, device=device)
    chain_starts = chain_starts.to(device)
    earlier = (start[None, :] < chain_starts[:, None])[None, :, :, None]  # [1, C, S, 1]
    own = (start[None, :] == chain_starts[:, None])[None, :, :, None]
    on_path = (slot < cuts[..., :1])[:, :, None, :]  # [bs, C, 1, K]
    parts = [(earlier | (own & on_path)).flatten(2)]  # [bs, C, S*K]
    same_chain = torch.eye(c, dtype=torch.bool, device=device)[None, :, :, None]
    for p in range(1, num_prev):
        on_path = (slot < cuts[..., p : p + 1])[:, :, None, :]  # [bs, C, 1, K]
        parts.append((same_chain & on_path).flatten(2))  # [bs, C, C*K]
    context = torch.cat(parts, dim=-1)  # [bs, C, ctx]; every slot of a block sees the same
    context = context[:, :, None, :].expand(bs, c, k, context.shape[-1]).reshape(bs, c * k, -1)
    block = own_block_mask(k, c, device).expand(bs, c * k, c * k)
    return torch.cat([context, block], dim=-1)


def gather_slot(
    values: torch.Tensor,  # [bs, C, K, ...]
    cut: torch.Tensor,  # [bs, C] 1-based slot
) -> torch.Tensor:  # [bs, C, ...] values at slot ``cut`` (0-based ``cut - 1``)
    """The value of each chain's block at its cut slot (the next block's start, §3.3)."""
    index = (cut - 1).view(*cut.shape, 1, *([1] * (values.dim() - 3)))
    index = index.expand(*cut.shape, 1, *values.shape[3:])
    return values.gather(2, index).squeeze(2)
