"""Batched SpecBlock drafting for one verifier iteration (paper Algorithm 2, App. A.2).

Pure tensor code: the drafter, its cached context keys/values and per-request inputs in,
draft trees out. The SGLang worker (``worker.py``) gathers the context from its drafter KV pool
(``draft_kv.py``) and turns the trees into a verify batch (``packing.py``).

How a decode step conditions the drafter, matching training (``trainer.chain_forward``):

- *Extend* (after prefill and after every verify): one block per newly processed position
  ``p`` -- conditioned on the target's (low, mid, top) features at ``p`` and the token ``x[p]``
  -- exactly training's pass 1. Each block sees every slot of the blocks of earlier positions
  (App. A.2 source 1) and is stored as the drafter's prefix context. Nothing it predicts is
  verified; it fills the context and yields the state ``h^(L)`` at slot 1 of the last block.
- *Tree rounds*: the next token (the verifier's bonus, position ``q + 1``) has no target
  features yet, so the first tree block is a cross-block start with cut ``s = 1`` from the last
  extend block (§3.3 cross-block training: condition on ``h^(L)`` at the cut slot, take the
  verified token there, see that block's slots ``1..s`` only). Later blocks start from nodes
  the rank head selects (``tree.expand_blocks``), conditioned on their cached ``h^(L)``, and
  see the on-path slots of every earlier block of the iteration (App. A.2 source 2).

So an iteration costs one extend forward plus up to M tree forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_spec.specblock.layout import own_block_mask
from sgl_spec.specblock.mask import ContextKV, block_attention_mask
from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.tree import (
    BUCKET_MAP_DEFAULT,
    DEFAULT_START_BUCKETS,
    BlockProposal,
    Start,
    expand_blocks,
    list_proposal,
    propose_from_logits,
    prune_to_budget,
)
from sgl_spec.specblock.workspace import KVWorkspace
from sgl_spec.verify.tree import DraftTree


@dataclass(frozen=True)
class DraftSettings:
    """Shape of the tree of one iteration (Algorithm 2 inputs, App. A.5 map)."""

    num_blocks: int = 2  # M, tree forwards per iteration
    bucket_map: tuple[int, int, int, int] = BUCKET_MAP_DEFAULT
    max_nodes: int = 32  # verifier budget per request, root included
    max_starts: int = 8  # next-block starts kept per request and round
    fixed_width: int = 2  # siblings per position when the drafter has no rank head
    use_rank_head: bool = True  # False: fixed_width trees even with a rank head (ablation)
    start_buckets: tuple[int, ...] = DEFAULT_START_BUCKETS

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.max_nodes < 1 or self.max_starts < 1:
            raise ValueError(f"num_blocks, max_nodes, max_starts must be >= 1: {self}")
        if len(self.bucket_map) != 4 or min(self.bucket_map) < 0 or max(self.bucket_map) < 1:
            raise ValueError(f"bucket_map needs 4 widths >= 0, one > 0: {self.bucket_map}")

    def max_depth(self, block_size: int) -> int:
        """Deepest node of a tree (root depth 0): M blocks of K positions."""
        return self.num_blocks * block_size


@dataclass
class PrefixContext:
    """Cached drafter keys/values a forward may attend to, padded across the batch: the first
    ``num_columns`` columns of ``kv`` (a step's forwards write their own blocks behind them)."""

    kv: KVWorkspace | ContextKV | None  # a per-layer list is moved into a workspace
    visible: torch.Tensor  # [bs, C] bool

    def __post_init__(self) -> None:
        if isinstance(self.kv, list):
            self.kv = KVWorkspace.from_context(self.kv) if self.kv else None

    @property
    def num_columns(self) -> int:
        return int(self.visible.shape[1])

    def reset(self) -> KVWorkspace | None:
        """The workspace with only the prefix visible (drops a previous forward's blocks)."""
        if self.kv is None:
            if self.num_columns:
                raise ValueError(f"no keys for a context of {self.num_columns} columns")
            return None
        if self.kv.capacity < self.num_columns:
            raise ValueError(
                f"context holds {self.kv.capacity} columns, visibility names {self.num_columns}"
            )
        self.kv.length = self.num_columns
        return self.kv


@dataclass
class ExtendResult:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [bs, n_kv, S*K, hd] each
    root_cond: torch.Tensor  # [bs, d] h^(L) at slot 1 of each request's last real block


@torch.no_grad()
def extend_prefix(
    drafter: SpecBlockDrafter,
    prefix: PrefixContext,
    features: torch.Tensor,  # [bs, S, 3*d_target] target features at each new position
    tokens: torch.Tensor,  # [bs, S] token at each new position
    positions: torch.Tensor,  # [bs, S] position of each new token
    num_new: torch.Tensor,  # [bs] real new positions per request (>= 1); the rest is padding
) -> ExtendResult:
    """One block per new position, in training's pass-1 layout (module docstring).

    Padding starts sit after the real ones, so no real query sees them (a start sees earlier
    starts only).
    """
    bs, s = tokens.shape
    k = drafter.config.block_size
    block = block_attention_mask(k, s, device=tokens.device)  # [S*K, S*K]
    context = prefix.visible[:, None, :].expand(bs, s * k, prefix.num_columns)
    mask = torch.cat([context, block.expand(bs, s * k, s * k)], dim=-1)
    out = drafter(
        features,
        tokens,
        from_draft=False,
        positions=positions,
        context_kv=prefix.reset(),
        attention_mask=mask,
        heads=False,  # nothing this pass predicts is used
    )
    last = (num_new.to(torch.long) - 1).clamp_min(0)
    root_cond = out.hidden[torch.arange(bs, device=tokens.device), last, 0]
    return ExtendResult(out.kv, root_cond)


@dataclass
class _Round:
    """One tree forward: every request's starts, padded to ``width``."""

    starts: list[list[Start]]
    width: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [bs, n_kv, width*K, hd]
    hidden: torch.Tensor  # [bs, width, K, d]


@dataclass
class DraftResult:
    trees: list[DraftTree]  # one per request, pruned to the budget
    num_forwards: int  # tree forwards run (extend excluded)
    num_blocks: list[int] = field(default_factory=list)  # blocks drafted per round
    round_logits: list[torch.Tensor] = field(default_factory=list)  # [bs, width, K, V_d]
    # per tree, per node: (round, row, slot) of the draft distribution that proposed it (the
    # root: (-1, -1, -1)); siblings share one. Read by serving-time adaptation (``adapt/serving.py``).
    node_source: list[list[tuple[int, int, int]]] = field(default_factory=list)


def _record_sources(
    tree: DraftTree,
    sources: list[tuple[int, int, int]],
    starts: Sequence[Start],
    round_index: int,
) -> None:
    """Extend ``sources`` to the nodes ``expand_blocks`` just added: a child of a start node is
    slot 0 of that start's row, any other new node the slot after its parent's."""
    row_of_start = {start.node: i for i, start in enumerate(starts)}
    first_new = len(sources)
    for node in range(first_new, tree.num_nodes):
        parent = tree.parents[node]
        if parent < first_new:
            sources.append((round_index, row_of_start[parent], 0))
        else:
            _, row, slot = sources[parent]
            sources.append((round_index, row, slot + 1))


def _path_rows(rounds: list[_Round], b: int, start: Start) -> list[tuple[int, int]]:
    """(row, slot) of the block the path to ``start`` leaves in each earlier round."""
    path: list[tuple[int, int]] = []
    row, slot, node = start.row, start.slot, start
    for r in range(len(rounds) - 1, -1, -1):
        path.append((row, slot))
        node = rounds[r].starts[b][row]
        row, slot = node.row, node.slot
    return path[::-1]


def _tree_round_mask(
    prefix_visible: torch.Tensor,  # [bs, C]
    rounds: list[_Round],
    starts: list[list[Start]],
    width: int,
    block_size: int,
) -> torch.Tensor:  # [bs, width*K, C + sum(round widths)*K + width*K] bool
    """Visibility of one tree forward (App. A.2, Figure 3): the prefix context, the on-path
    slots ``0..j`` of the one block per earlier round the start's path runs through, and its
    own block causally. Padding starts see only their own block. (The starts' cells are
    listed in Python and set in one indexed write: a few tensor ops whatever the batch.)"""
    k = block_size
    bs, c = prefix_visible.shape
    device = prefix_visible.device
    offsets, off = [], c
    for r in rounds:
        offsets.append(off)
        off += r.width * k
    real = [[False] * width for _ in range(bs)]
    cells: tuple[list[int], list[int], list[int]] = ([], [], [])
    for b, request_starts in enumerate(starts):
        for i, start in enumerate(request_starts):
            real[b][i] = True
            for (row, slot), base in zip(_path_rows(rounds, b, start), offsets, strict=True):
                first = base + row * k
                cells[0].extend([b] * (slot + 1))
                cells[1].extend([i] * (slot + 1))
                cells[2].extend(range(first, first + slot + 1))
    context = torch.zeros(bs, width, off, dtype=torch.bool, device=device)
    real_starts = torch.tensor(real, dtype=torch.bool, device=device)
    context[:, :, :c] = prefix_visible[:, None, :] & real_starts[:, :, None]
    if cells[0]:
        index = torch.tensor(cells, dtype=torch.long, device=device)
        context[index[0], index[1], index[2]] = True
    context = context.repeat_interleave(k, dim=1)
    own = own_block_mask(k, width, device).expand(bs, width * k, width * k)
    return torch.cat([context, own], dim=-1)


def _round_inputs(
    trees: list[DraftTree],
    starts: list[list[Start]],
    width: int,
    positions_base: list[int],
    root_cond: torch.Tensor,  # [bs, d]
    rounds: list[_Round],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conditioning state [bs, width, d], token ids and positions [bs, width] of a round's
    blocks: each start node's token and depth, and the ``h^(L)`` it continues from (one row
    gather from the roots' states, a zero row for padding and the last round's states)."""
    bs, d = root_cond.shape
    zero_row, hidden_base = bs, bs + 1
    ids = [[0] * width for _ in range(bs)]
    pos = [[0] * width for _ in range(bs)]
    source = [[zero_row] * width for _ in range(bs)]
    _, last_width, k, _ = rounds[-1].hidden.shape if rounds else (bs, 0, 0, d)
    for b, request_starts in enumerate(starts):
        tree = trees[b]
        for i, start in enumerate(request_starts):
            ids[b][i] = tree.tokens[start.node]
            pos[b][i] = positions_base[b] + tree.depth[start.node]
            source[b][i] = (
                b if start.row < 0 else hidden_base + (b * last_width + start.row) * k + start.slot
            )
    parts = [root_cond, root_cond.new_zeros(1, d)]
    if rounds:
        parts.append(rounds[-1].hidden.reshape(-1, d).to(root_cond.dtype))
    index = torch.tensor(source, dtype=torch.long, device=root_cond.device).view(-1)
    cond = torch.cat(parts).index_select(0, index).view(bs, width, d)
    return cond, torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long)


def _expand_round(
    trees: list[DraftTree],
    sources: list[list[tuple[int, int, int]]],
    starts: list[list[Start]],
    proposal: BlockProposal,  # rows: request b's blocks at b * width ...
    width: int,
    settings: DraftSettings,
    round_index: int,
) -> list[list[Start]]:
    """Attach each request's proposed blocks to its tree; returns the next round's starts (the
    best ``max_starts`` by cumulative draft log-probability)."""
    candidates: list[list[Start]] = []
    listed = list_proposal(proposal, settings.bucket_map, settings.fixed_width)  # one host copy
    for b, request_starts in enumerate(starts):
        if not request_starts:
            candidates.append([])
            continue
        sub = listed.rows(b * width, b * width + len(request_starts))
        found = expand_blocks(trees[b], request_starts, sub, start_buckets=settings.start_buckets)
        _record_sources(trees[b], sources[b], request_starts, round_index)
        found.sort(key=lambda s, t=trees[b]: (-t.score[s.node], s.node))
        candidates.append(found[: settings.max_starts])
    return candidates


def _round_proposal(
    out: Any, drafter: SpecBlockDrafter, settings: DraftSettings, used: int, max_width: int
) -> BlockProposal:
    """Top tokens (and rank buckets, when the rank head shapes the tree) of the first ``used``
    positions of every block of a round."""
    rank = None
    if out.rank_logits is not None and settings.use_rank_head:
        rank = out.rank_logits[:, :, :used].flatten(0, 1)
    if out.proposal is not None:  # the heads' native call ranked the candidates already
        top = out.proposal
        buckets = None if rank is None else rank.argmax(-1)
        return BlockProposal(top.top_tokens[:, :used], top.top_logprobs[:, :used], buckets)
    logits = out.logits[:, :, :used].flatten(0, 1).float()  # a bfloat16 drafter's too
    return propose_from_logits(logits, drafter.d2t, rank, max_width)


def _keep_round_keys(workspace: KVWorkspace | None, kv: ContextKV) -> KVWorkspace:
    """Make a tree round's keys (already written behind the visible columns) visible to the
    later rounds; with no prefix they start the workspace."""
    if workspace is None:
        return KVWorkspace.from_context(kv)
    workspace.length += int(kv[0][0].shape[2])
    return workspace


@torch.no_grad()
def grow_trees(
    drafter: SpecBlockDrafter,
    prefix: PrefixContext,
    root_cond: torch.Tensor,  # [bs, d] drafter state the first block conditions on
    root_tokens: Sequence[int],  # [bs] the verified token each tree is rooted at
    root_positions: torch.Tensor,  # [bs] position of the root token
    settings: DraftSettings,
    block_size: int | None = None,  # positions used per block, <= the drafter's K
) -> DraftResult:
    """Algorithm 2 lines 2-10 for a batch: up to M batched drafter forwards, then the budget.

    With ``block_size`` below the drafter's K only the first positions of each block join the
    tree (they do not depend on later ones: causal attention, shift from the previous slot).
    """
    k = drafter.config.block_size
    used = k if block_size is None else block_size
    if not 1 <= used <= k:
        raise ValueError(f"block_size {block_size} outside 1..{k}")
    max_width = max(max(settings.bucket_map), settings.fixed_width)
    trees = [DraftTree.rooted_at(t) for t in root_tokens]
    sources: list[list[tuple[int, int, int]]] = [[(-1, -1, -1)] for _ in trees]
    starts: list[list[Start]] = [[Start(0)] for _ in trees]
    rounds: list[_Round] = []
    counts: list[int] = []
    logits_per_round: list[torch.Tensor] = []
    workspace = prefix.reset()  # each round's keys stay behind the prefix for later rounds
    positions_base = root_positions.to(torch.long).tolist()
    for _ in range(settings.num_blocks):
        starts = [
            s if trees[b].num_nodes < settings.max_nodes else [] for b, s in enumerate(starts)
        ]
        width = max(len(s) for s in starts)
        if width == 0:
            break
        cond, ids, pos = _round_inputs(trees, starts, width, positions_base, root_cond, rounds)
        mask = _tree_round_mask(prefix.visible, rounds, starts, width, k)
        out = drafter(
            cond,
            ids.to(root_cond.device),
            from_draft=True,
            positions=pos.to(root_cond.device),
            context_kv=workspace,
            attention_mask=mask,
            propose=max_width,
        )
        workspace = _keep_round_keys(workspace, out.kv)
        proposal = _round_proposal(out, drafter, settings, used, max_width)
        candidates = _expand_round(trees, sources, starts, proposal, width, settings, len(rounds))
        rounds.append(_Round(starts, width, out.kv, out.hidden))
        counts.append(sum(len(s) for s in starts))
        logits_per_round.append(out.logits)
        starts = candidates
    prefix.reset()
    pruned = [prune_to_budget(tree, settings.max_nodes) for tree in trees]
    kept_sources = [
        [tree_sources[i] for i in kept]
        for (_, kept), tree_sources in zip(pruned, sources, strict=True)
    ]
    return DraftResult([t for t, _ in pruned], len(rounds), counts, logits_per_round, kept_sources)
