"""An n-gram branch in SPECBLOCK's draft tree (``--specblock-ngram N``).

SGLang's model-free NGRAM drafts from a trie of the n-grams it has seen (``NgramCorpus``, C++).
Text that repeats -- code, a model that loops, a prompt the answer quotes -- is where it wins and
where a small drafter is least sure. Here the same corpus offers a small tree of up to ``N``
nodes (root included) per request; it is merged into the drafter's tree (a node whose token the
drafter proposed at the same place is shared, the rest hang off it) and the merged tree is cut to
the step's node budget as before, so the verify forward keeps its shape.

An n-gram node scores its parent's score plus ``log r``, where ``r`` is the measured rate at
which n-gram-only nodes were accepted when their parent was, for matches as deep as this
request's (decayed counts, prior 1/2): the cut then weighs them against the drafter's nodes by
the same measure, cumulative log-probability of acceptance. A step may also verify the n-gram
trees alone, without the drafter's tree forwards, where that is expected to commit more tokens
per second (``ngram_choice.py``); the drafter then reads those tokens at its next drafting
step. Verification is the target's alone (SGLang's tree verify), so outputs are unchanged.

What the corpus holds: each request's prompt and output, inserted as it goes (every n-gram up to
the trie depth, from each position once), and kept across requests as NGRAM keeps them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sgl_spec.specblock.drafting import DraftResult
from sgl_spec.specblock.ngram_choice import DrafterChoice
from sgl_spec.specblock.tree import prune_to_budget
from sgl_spec.verify.tree import DraftTree

logger = logging.getLogger(__name__)
MAX_TRIE_DEPTH = 18  # SGLang's --speculative-ngram-max-trie-depth default
CORPUS_CAPACITY = 1_000_000  # trie nodes kept (SGLang's default is 10M; ours shares the host)
RATE_DECAY = 0.995  # per request-step observed in a bucket: the last few hundred count


def is_padding(parent: int, token: int) -> bool:
    """The corpus pads a short match with token 0 under the root."""
    return parent == 0 and token == 0


def new_corpus(num_nodes: int) -> Any:
    """SGLang's n-gram corpus with its default search (BFS, breadth 1..10) for trees of
    ``num_nodes`` nodes."""
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    return NgramCorpus(
        max_trie_depth=MAX_TRIE_DEPTH,
        min_bfs_breadth=1,
        max_bfs_breadth=10,
        draft_token_num=num_nodes,
        match_type="BFS",
        capacity=CORPUS_CAPACITY,
    )


def mask_parents(mask: np.ndarray) -> np.ndarray:  # [..., n] parent of each node, -1: root
    """Parents from ancestor masks (``mask[..., i, j]``: j is i or an ancestor of i; any
    leading batch dimensions): the nearest ancestor is the largest marked j < i."""
    n = mask.shape[-1]
    order = np.arange(n)
    ancestors = mask.astype(bool) & (order[None, :] < order[:, None])
    return np.where(ancestors.any(-1), (ancestors * order).argmax(-1), -1)


def merge_ngram_tree(
    tree: DraftTree,
    tokens: Sequence[int],  # n-gram tree, root first
    parents: Sequence[int],
    log_rate: float,
    max_depth: int,
) -> list[int]:
    """Add the n-gram tree's nodes to ``tree`` in place (nodes the drafter already proposed at
    the same place are shared, not added); returns the nodes it added. The corpus pads a short
    match (``is_padding``): those are skipped."""
    if not tokens or int(tokens[0]) != tree.tokens[0]:
        return []
    child = {(tree.parents[i], tree.tokens[i]): i for i in range(1, tree.num_nodes)}
    placed: list[int | None] = [0]
    added = []
    for i in range(1, len(tokens)):
        p = int(parents[i])
        at = placed[p] if 0 <= p < i else None
        token = int(tokens[i])
        if at is None or is_padding(p, token) or tree.depth[at] >= max_depth:
            placed.append(None)
            continue
        node = child.get((at, token))
        if node is None:
            node = tree.add(token, at, log_rate)
            child[(at, token)] = node
            added.append(node)
        placed.append(node)
    return added


def ngram_holds(tokens: Sequence[int], parents: Sequence[int], drafts: Sequence[int]) -> int:
    """How many of ``drafts`` (an accepted path's tokens after the root) the n-gram tree holds
    as a chain from its root: what a step verifying that tree alone would have accepted
    (greedy; padding nodes hold nothing)."""
    children = {
        (parents[i], tokens[i]): i
        for i in range(1, len(tokens))
        if not is_padding(parents[i], tokens[i])
    }
    at = count = 0
    for token in drafts:
        at = children.get((at, token))
        if at is None:
            break
        count += 1
    return count


@dataclass
class _Merged:
    """Per request of the last step: its n-gram-only nodes (indices in the verified tree), its
    n-gram tree, and its match-depth bucket."""

    added: set[int]
    tokens: list[int]
    parents: list[int]
    bucket: int


class NgramBranch:
    """The corpus, what each request has put in it, the n-gram nodes' acceptance rate and the
    choice of steps without the drafter (``ngram_choice.py``)."""

    def __init__(
        self, num_nodes: int, corpus: Any = None, agree: Callable[[bool], bool] | None = None
    ) -> None:
        self.num_nodes = num_nodes
        self.agree = agree  # rank 0's choice on every tensor-parallel rank (None: one rank)
        self.corpus = new_corpus(num_nodes) if corpus is None else corpus
        self._inserted: dict[str, int] = {}  # rid -> tokens whose n-grams are in the corpus
        self._last: list[_Merged] = []
        self._reqs: Sequence[Any] = ()  # the batch of the last step
        self._matched: tuple | None = None  # plan's (tokens, parents, buckets) for draft
        self._match_pending = False  # plan left the match to draft (no skip possible)
        self._skipped = False  # the last step ran without the drafter
        self._drafting_s = 0.0  # the last step's drafter tree forwards
        self.choice = DrafterChoice(num_nodes)
        # per match-depth bucket, decayed: n-gram-only nodes whose parent was accepted, and
        # those accepted themselves
        self.offered = [0.0] * num_nodes
        self.accepted = [0.0] * num_nodes

    def reset(self) -> None:
        """Empty corpus and no request state (``/flush_cache``). The measured rates and step
        times stay, as the node-budget controller's do: they describe the models and the host,
        not what was cached. An insert still running on the corpus's thread finishes first, so
        that it cannot land in the emptied corpus."""
        self.corpus.synchronize()
        self.corpus.reset()
        self._inserted.clear()
        self._last = []

    @property
    def skipped(self) -> bool:
        """The last step verified the n-gram trees alone, without the drafter's."""
        return self._skipped

    def summary(self) -> str:
        """For SPECBLOCK's log line: the n-gram-only nodes' acceptance rate and the steps run
        without the drafter."""
        rate = (sum(self.accepted) + 1.0) / (sum(self.offered) + 2.0)
        return f"ngram_rate={rate:.2f} steps_without_drafter={self.choice.skipped}"

    def log_rate(self, bucket: int) -> float:
        """Log of the rate at which n-gram-only nodes of matches this deep were accepted when
        their parent was (prior 1/2)."""
        return math.log((self.accepted[bucket] + 1.0) / (self.offered[bucket] + 2.0))

    def _insert(self, reqs: Sequence[Any]) -> None:
        """Put in the corpus what each request has committed since its last insert (from
        ``MAX_TRIE_DEPTH - 1`` tokens back, so that every n-gram ending in a new token is in).
        The insert runs on the corpus's own thread while the step finishes; the next match waits
        for it. Requests that left the batch lose their match state."""
        rids = {req.rid for req in reqs}
        departed = [rid for rid in self._inserted if rid not in rids]
        for rid in departed:
            del self._inserted[rid]
        if departed:
            self.corpus.erase_match_state(departed)
        puts = []
        for req in reqs:
            prompt, output = req.origin_input_ids_unpadded, req.output_ids
            total = len(prompt) + len(output)
            start = max(0, self._inserted.get(req.rid, 0) - (MAX_TRIE_DEPTH - 1))
            puts.append(_tokens_between(prompt, output, start, total))
            self._inserted[req.rid] = total
        self.corpus.batch_put(puts)

    def _match(self, reqs: Sequence[Any]) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Each request's n-gram tree (tokens, parents) and match-depth bucket."""
        if any(req.rid not in self._inserted for req in reqs):  # a new request's prompt
            self._insert(reqs)
        self.corpus.synchronize()
        totals, tails = [], []
        for req in reqs:
            prompt, output = req.origin_input_ids_unpadded, req.output_ids
            total = len(prompt) + len(output)
            totals.append(total)
            tails.append(_tokens_between(prompt, output, max(0, total - MAX_TRIE_DEPTH), total))
        ids, masks = self.corpus.batch_get([r.rid for r in reqs], tails, totals)
        n = self.num_nodes
        tokens = ids.reshape(len(reqs), n).tolist()
        masks = masks.reshape(len(reqs), n, n)
        parents = mask_parents(masks).tolist()  # the batch in one go
        buckets = [match_depth(t, p) for t, p in zip(tokens, parents, strict=True)]
        return tokens, parents, buckets

    def plan(self, reqs: Sequence[Any], may_skip: bool = True) -> bool:
        """Choose whether this step runs the drafter (``ngram_choice.py``; never where not
        ``may_skip``); True: verify the n-gram trees alone. Called before the node-budget
        controller decides, so that a step without the drafter is no step of its settings.
        Only a step that may skip matches here; otherwise ``draft`` matches, so a step the
        controller then runs without drafts pays no match. Under tensor parallelism rank 0's
        choice holds on every rank (``agree``): each rank times its own steps. Any failure of
        the n-gram side leaves the drafter's trees alone (logged)."""
        self._reqs, self._last, self._matched, skips = reqs, [], None, False
        if may_skip:
            self._matched = self._try_match()
            skips = self._matched is not None and self.choice.skips(self._matched[2])
        agreed = skips if self.agree is None else self.agree(skips)
        if agreed and not may_skip:  # rank 0 skips where this rank would not have
            self._matched = self._try_match()
        self._skipped = agreed and self._matched is not None
        self._match_pending = not may_skip and not agreed  # draft matches if it drafts
        return self._skipped

    def _try_match(self) -> tuple | None:
        try:
            return self._match(self._reqs)
        except Exception:
            logger.exception("SPECBLOCK n-gram branch failed; the drafter's trees alone this step")
            return None

    def draft(
        self,
        roots: Sequence[int],
        max_nodes: int,
        max_depth: int,
        run_drafter: Callable[[], tuple[DraftResult, Any]],
    ) -> tuple[DraftResult, Any]:
        """The trees of the step ``plan`` chose: the n-gram trees alone, or the drafter's
        (``run_drafter``) merged with them; cut to ``max_nodes`` nodes, ``max_depth`` deep."""
        if self._match_pending:
            self._matched, self._match_pending = self._try_match(), False
        matched, self._matched = self._matched, None
        if matched is None:  # the match failed
            return run_drafter()
        tokens, parents, buckets = matched
        if self._skipped:
            drafted, context = DraftResult([DraftTree.rooted_at(t) for t in roots], 0), None
        else:
            tic = time.perf_counter()
            drafted, context = run_drafter()
            self._drafting_s = time.perf_counter() - tic
        trees = []
        for i, tree in enumerate(drafted.trees):
            merged = DraftTree(list(tree.tokens), list(tree.parents), list(tree.depth),
                               list(tree.score))  # fmt: skip
            log_rate = self.log_rate(buckets[i])
            added = set(merge_ngram_tree(merged, tokens[i], parents[i], log_rate, max_depth))
            pruned, kept = prune_to_budget(merged, max_nodes)
            trees.append(pruned)
            self._last.append(
                _Merged(
                    {new for new, old in enumerate(kept) if old in added},
                    tokens[i],
                    parents[i],
                    buckets[i],
                )
            )
        # the drafter's per-node records (adaptation's) do not describe the merged trees
        return replace(drafted, trees=trees, node_source=[]), context

    def observe(
        self, trees: Sequence[DraftTree], paths: Sequence[Sequence[int]], step_s: float
    ) -> None:
        """After the verify (``paths``: accepted nodes per request, root first): the n-gram-only
        nodes' acceptance rate, and the drafter choice's statistics."""
        if len(self._last) != len(paths):
            return  # the n-gram side failed this step
        self._insert(self._reqs)
        for tree, path, last in zip(trees, paths, self._last, strict=True):
            on_path, b = set(path), last.bucket
            self.offered[b] *= RATE_DECAY
            self.accepted[b] *= RATE_DECAY
            for node in last.added:
                if tree.parents[node] in on_path:
                    self.offered[b] += 1.0
                    self.accepted[b] += float(node in on_path)
        self.choice.observe(
            [last.bucket for last in self._last],
            self._skipped,
            [len(path) - 1 for path in paths],
            [
                ngram_holds(last.tokens, last.parents, [tree.tokens[n] for n in path[1:]])
                for tree, path, last in zip(trees, paths, self._last, strict=True)
            ],
            step_s,
            self._drafting_s,
        )


def match_depth(tokens: Sequence[int], parents: Sequence[int]) -> int:
    """Depth of the n-gram tree's deepest real node (``is_padding`` nodes are not)."""
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        p = int(parents[i])
        if p < 0 or is_padding(p, int(tokens[i])) or (p > 0 and depth[p] == 0):
            continue
        depth[i] = depth[p] + 1
    return max(depth)


def _tokens_between(prompt: Sequence[int], output: Sequence[int], start: int, stop: int):
    """Tokens ``start .. stop-1`` of prompt + output, without joining the two whole."""
    n = len(prompt)
    head = list(prompt[start:stop]) if start < n else []
    return head + list(output[max(0, start - n) : max(0, stop - n)])
