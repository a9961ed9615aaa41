"""Rank-guided draft tree of SpecBlock (paper §3.2, App. A.5, Algorithm 2) as pure functions.

One verifier iteration grows the tree in at most M block expansions. A block drafted from a
start node proposes K positions; position ``k`` attaches the top-``b(bucket_k)`` tokens of its
draft distribution as siblings (Algorithm 2, line 7). The block's own path is its greedy chain:
the siblings at position ``k`` hang off the top-1 node of position ``k-1`` (the start node for
``k = 1``), since the drafter's later positions are conditioned on that chain. A width of 0
(the give-up bucket of ``[2, 4, 10, 0]``) stops the block there: nothing at ``k`` or deeper.

Next-block starts (line 9) are chosen from the rank buckets: the alternatives (non-top-1
siblings) at positions whose bucket is in ``start_buckets`` (default: the uncertain but
recoverable b1, b2), and the end of every block whose chain ran all K positions. Each start
carries the block row and slot of the cached ``h^(L)`` it continues from. Finally the tree is
cut to a node budget by cumulative draft log-probability, which keeps every kept node's
ancestors (a child's score never exceeds its parent's).

The tree itself and its flattening for the verifier live in ``sgl_spec/verify/tree.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl_spec.verify.tree import DraftTree

BUCKET_MAP_DEFAULT = (2, 4, 10, 0)  # App. A.5: give up on the rank > 10 bucket
BUCKET_MAP_FALLBACK = (2, 4, 6, 4)  # App. A.5: keeps a 4-candidate fallback at give-up positions
DEFAULT_START_BUCKETS = (1, 2)


def branch_widths(
    buckets: torch.Tensor,  # [..., K] predicted bucket per position (argmax of rank logits)
    bucket_map: Sequence[int] = BUCKET_MAP_DEFAULT,
) -> torch.Tensor:  # [..., K] long, siblings to attach per position
    """Per-position branching width ``b(bucket)`` (§3.2 "Bucket-driven branching", App. A.5)."""
    if len(bucket_map) != 4 or min(bucket_map) < 0:
        raise ValueError(f"bucket_map needs 4 widths >= 0, got {tuple(bucket_map)}")
    table = torch.tensor(list(bucket_map), dtype=torch.long, device=buckets.device)
    return table[buckets.long()]


@dataclass(frozen=True)
class Start:
    """A block starting point (Algorithm 2, lines 2 and 9).

    ``row``/``slot`` locate the cached ``h^(L)`` in the previous block forward's output
    (``-1`` for the first block, which uses the target's features). ``path_slots`` are the
    slots by which the path to this start leaves each earlier block of the iteration (the
    cross-block visibility of App. A.2, see ``mask.cross_block_visibility``).
    """

    node: int
    row: int = -1
    slot: int = -1
    path_slots: tuple[int, ...] = ()


@dataclass
class BlockProposal:
    """What one batched drafter forward proposes for ``n`` starts."""

    top_tokens: torch.Tensor  # [n, K, W] target ids, best first
    top_logprobs: torch.Tensor  # [n, K, W] draft log-probabilities of those tokens
    buckets: torch.Tensor | None  # [n, K] predicted rank bucket; None without a rank head


def propose_from_logits(
    logits: torch.Tensor,  # [n, K, V_d] draft logits
    d2t: torch.Tensor,  # [V_d] target id of each draft id
    rank_logits: torch.Tensor | None,  # [n, K, 4]
    max_width: int,
) -> BlockProposal:
    """Top-``max_width`` candidates per position, mapped to target ids."""
    logprobs = logits.float().log_softmax(-1)
    top = logprobs.topk(min(max_width, logits.shape[-1]), dim=-1)
    buckets = None if rank_logits is None else rank_logits.argmax(-1)
    return BlockProposal(d2t[top.indices], top.values, buckets)


@dataclass
class ListedProposal:
    """A ``BlockProposal`` as Python lists, copied to the host once for a whole batch: per block
    and position the widths to attach, the candidates' target ids and log-probabilities, and
    the predicted bucket (-1 without a rank head)."""

    widths: list[list[int]]
    tokens: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    buckets: list[list[int]]

    def rows(self, start: int, stop: int) -> ListedProposal:
        """Blocks ``start .. stop-1`` (one request's starts of a batched round)."""
        return ListedProposal(
            self.widths[start:stop],
            self.tokens[start:stop],
            self.logprobs[start:stop],
            self.buckets[start:stop],
        )


def list_proposal(
    proposal: BlockProposal, bucket_map: Sequence[int] = BUCKET_MAP_DEFAULT, fixed_width: int = 2
) -> ListedProposal:
    """Each position's width (``fixed_width`` without a rank head, else ``b(bucket)``, at most
    the candidates proposed) and the proposal as lists."""
    n, k, most = proposal.top_tokens.shape
    if proposal.buckets is None:
        widths = torch.full((n, k), fixed_width, dtype=torch.long)
        buckets = torch.full((n, k), -1, dtype=torch.long)
    else:
        buckets = proposal.buckets.cpu()
        widths = branch_widths(buckets, bucket_map)
    return ListedProposal(
        widths.clamp(max=most).tolist(),
        proposal.top_tokens.tolist(),
        proposal.top_logprobs.tolist(),
        buckets.tolist(),
    )


def expand_blocks(
    tree: DraftTree,
    starts: Sequence[Start],
    proposal: BlockProposal | ListedProposal,
    bucket_map: Sequence[int] = BUCKET_MAP_DEFAULT,
    fixed_width: int = 2,
    start_buckets: Sequence[int] = DEFAULT_START_BUCKETS,
) -> list[Start]:
    """Attach one block per start to ``tree`` (in place); return the candidate next starts.

    Without a rank head (``proposal.buckets is None``, the Table 2 ablation) every position
    gets ``fixed_width`` siblings and only chain ends start later blocks. A listed proposal
    carries its widths already (``bucket_map`` and ``fixed_width`` then unused).
    """
    listed = (
        proposal
        if isinstance(proposal, ListedProposal)
        else list_proposal(proposal, bucket_map, fixed_width)
    )
    if len(starts) != len(listed.tokens):
        raise ValueError(f"{len(starts)} starts but a proposal for {len(listed.tokens)}")
    widths, tokens, logprobs, buckets = (
        listed.widths,
        listed.tokens,
        listed.logprobs,
        listed.buckets,
    )
    next_starts: list[Start] = []
    for i, start in enumerate(starts):
        parent = start.node
        k = len(widths[i])
        for slot in range(k):
            width = widths[i][slot]
            if width == 0:
                break
            children = [
                tree.add(tokens[i][slot][j], parent, logprobs[i][slot][j]) for j in range(width)
            ]
            if buckets[i][slot] in start_buckets:
                path = (*start.path_slots, slot)
                next_starts += [Start(c, i, slot, path) for c in children[1:]]
            parent = children[0]
        else:
            next_starts.append(Start(parent, i, k - 1, (*start.path_slots, k - 1)))
    return next_starts


def budget_order(tree: DraftTree) -> list[int]:
    """The non-root nodes, best first, as ``prune_to_budget`` keeps them: by score, ties by
    creation order (an ancestor scores no lower than its descendants and precedes them)."""
    return sorted(range(1, tree.num_nodes), key=lambda i: (-tree.score[i], i))


def accepted_within_budgets(
    tree: DraftTree, path: Sequence[int], budgets: Sequence[int]
) -> list[int]:
    """For each node budget, how many of ``path``'s drafts (node indices, root first) a tree
    pruned to that many nodes would still hold and so have accepted: the leading nodes of the
    path among the ``budget - 1`` best (``budget_order``, sorted once for all budgets). Ranks
    rise along a path (an ancestor ranks ahead of its descendants), so that is the count of
    path drafts ranked below ``budget - 1``."""
    rank = {node: r for r, node in enumerate(budget_order(tree))}
    ranks = [rank[node] for node in path[1:]]
    return [sum(1 for r in ranks if r < budget - 1) for budget in budgets]


def observed_budgets(
    trees: Sequence[DraftTree],
    paths: Sequence[Sequence[int]],
    budgets: Sequence[int],
    k: int,
    num_accepted: list[int],
) -> dict[int, list[int]]:
    """The accepted drafts per request at setting k (``budgets[k]`` nodes), and at each smaller
    budget but 1 as if the step had verified only the best-scoring nodes of its trees
    (``accepted_within_budgets``): the controller then learns the budgets' ratios on the same
    steps, not on probes of a few steps each at different times (where one noisy probe could
    pin a smaller budget for good)."""
    smaller = budgets[1:k]
    per_request = [
        accepted_within_budgets(tree, path, smaller)
        for tree, path in zip(trees, paths, strict=True)
    ]
    observed = {j + 1: [counts[j] for counts in per_request] for j in range(len(smaller))}
    observed[k] = num_accepted
    return observed


def prune_to_budget(tree: DraftTree, max_nodes: int) -> tuple[DraftTree, list[int]]:
    """Keep the root and the ``max_nodes - 1`` best-scoring nodes; returns the pruned tree and
    the old index of each kept node (creation order, so parents still precede children)."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    if tree.num_nodes <= max_nodes:
        return tree, list(range(tree.num_nodes))
    kept = [0, *sorted(budget_order(tree)[: max_nodes - 1])]
    new_index = {old: new for new, old in enumerate(kept)}
    pruned = DraftTree.rooted_at(tree.tokens[0])
    for old in kept[1:]:
        parent = tree.parents[old]
        if parent not in new_index:
            raise AssertionError("budget cut dropped an ancestor")  # scores must be monotone
        pruned.tokens.append(tree.tokens[old])
        pruned.parents.append(new_index[parent])
        pruned.depth.append(tree.depth[old])
        pruned.score.append(tree.score[old])
    return pruned, kept
