"""Cost-aware adaptation inside the serving loop (paper §3.4, Algorithm 1, Figure 4): what the
SPECBLOCK worker calls after each verify when ``--specblock-adapt`` is on. No SGLang import:
the worker hands over plain tensors and lists.

Per verify and request: ``r``, the drafter's probability of the token the target chose at the
rejected position (the bonus token; read from the draft logits ``grow_trees`` already computed,
no extra forward), accumulates into the query's signal ``s`` (Eq. 8); the accepted tokens and
the target features captured for them extend the request's history, cut into ``TrainExample``
windows. A *query* is one request's run of decode steps: it ends when its request leaves the
decode batch or its length stops continuing (a finished, aborted or retracted request), and is
then handed to the bandit with its examples. Trained weights enter ``theta_inf`` only in
``before_draft``, called by the worker at the start of a decode step (the drafter is idle), and
only between two of the trainer's optimizer steps.

Adaptation changes drafts only: verification, and so every output token, is untouched. A
failed update (the trainer raising, a non-finite loss) is discarded whole and the drafter in
service keeps drafting; after ``MAX_FAILED_UPDATES`` failures in a row adaptation turns itself
off for the server's life, with a log line, rather than train on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_spec.specblock.adapt.policy import Action, AdaptConfig, CostAwareBandit, Mark
from sgl_spec.specblock.adapt.update import (
    BackgroundTrainer,
    DrafterCopies,
    TrainExample,
    cut_windows,
)
from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.training.losses import target_to_draft_map

logger = logging.getLogger(__name__)
MAX_FAILED_UPDATES = 3  # in a row, before adaptation turns itself off


def rejected_prob(
    parents: Sequence[int],  # per tree node
    node_source: Sequence[tuple[int, int, int]],  # per tree node: (round, row, slot)
    round_logits: Sequence[torch.Tensor],  # per round [bs, width, K, V_d]
    request: int,
    path: Sequence[int],  # accepted nodes, root first
    chosen_draft_id: int,  # the target's token at the rejected position, -1 outside V_d
) -> float | None:
    """``r`` of Eq. (8) for one verified path: the drafter's probability of the target's token
    at the position after the path, from the distribution that proposed the path end's
    children (siblings share one). None when the tree offered nothing there."""
    last = path[-1]
    child = next((i for i, p in enumerate(parents) if p == last), None)
    if child is None or child >= len(node_source):
        return None
    round_index, row, slot = node_source[child]
    if chosen_draft_id < 0:
        return 0.0
    logits = round_logits[round_index][request, row, slot].float()  # [V_d]
    return float(logits.softmax(-1)[chosen_draft_id])


@dataclass
class _Query:
    next_len: int  # the sequence length its next decode step must have
    signal: float = 0.0
    verifies: int = 0
    committed: int = 0
    features: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] each
    tokens: list[int] = field(default_factory=list)
    examples: list[TrainExample] = field(default_factory=list)


class OnlineAdapter:
    """Owns the bandit, the drafter copies and the trainer thread (module docstring)."""

    def __init__(self, drafter: SpecBlockDrafter, cfg: AdaptConfig) -> None:
        self.cfg = cfg
        self.block_size = drafter.config.block_size
        self.t2d = target_to_draft_map(drafter.d2t, drafter.config.target_vocab_size).cpu()
        self.bandit: CostAwareBandit[TrainExample] = CostAwareBandit(cfg)
        self.copies = DrafterCopies(drafter, cfg)
        self.trainer = BackgroundTrainer(self.copies)
        self.queries: dict[Hashable, _Query] = {}
        self.tokens_total = 0
        self.num_failed = 0  # updates failed in a row
        self.enabled = True

    # ---- serving-thread hooks ----------------------------------------------------------------

    def before_draft(self, now: float | None = None) -> None:
        """Step boundary: collect finished updates, sync ready weights into ``theta_inf``."""
        while self.enabled and not self.trainer.results.empty():
            action, loss = self.trainer.results.get_nowait()
            self.num_failed = self.num_failed + 1 if loss is None else 0
            if loss is None and self.bandit.pending:
                self.bandit.on_failed()
            if self.num_failed >= MAX_FAILED_UPDATES:
                self._disable()
        if self.enabled and self.bandit.pending and self.copies.sync():
            self.bandit.on_synced(self._mark(now))

    def after_verify(
        self,
        req_keys: Sequence[Hashable],  # [bs] request id (or pool slot) of each request
        seq_lens: Sequence[int],  # [bs] lengths before this step
        draft_parents: Sequence[Sequence[int]],  # per request, its tree's parents
        node_source: Sequence[Sequence[tuple[int, int, int]]],  # per request (may be empty)
        round_logits: Sequence[torch.Tensor],
        paths: Sequence[Sequence[int]],  # per request, accepted nodes root first
        path_tokens: torch.Tensor,  # [bs, >= max path len] token of each accepted node
        features: torch.Tensor,  # [bs, >= max path len, F] target features of those nodes
        bonus: Sequence[int],  # [bs] the target's token after each path
        now: float | None = None,
    ) -> None:
        if not self.enabled:
            return
        now = time.perf_counter() if now is None else now
        live = set()
        path_tokens, features = path_tokens.cpu(), features.detach().float().cpu()
        for b, key in enumerate(req_keys):
            live.add(key)
            query = self.queries.get(key)
            if query is None or query.next_len != seq_lens[b]:
                if query is not None:
                    self._finish(query, now)
                query = self.queries[key] = _Query(seq_lens[b])
            n = len(paths[b])
            query.next_len = seq_lens[b] + n
            query.verifies += 1
            query.committed += n
            self.tokens_total += n
            sources = node_source[b] if b < len(node_source) else ()
            if sources:
                chosen = int(self.t2d[bonus[b]]) if 0 <= bonus[b] < self.t2d.numel() else -1
                r = rejected_prob(draft_parents[b], sources, round_logits, b, paths[b], chosen)
                if r is not None:
                    query.signal += 1.0 - min(max(r, 0.0), 1.0)
            self._extend_history(query, features[b, :n], path_tokens[b, :n].tolist())
        for key in [k for k in self.queries if k not in live]:
            self._finish(self.queries.pop(key), now)

    # ---- internals ---------------------------------------------------------------------------

    def _disable(self) -> None:
        self.enabled = False
        self.queries.clear()
        self.trainer.close()
        logger.warning(
            "SPECBLOCK adapt: %d updates failed in a row; adaptation off, drafting goes on"
            " with the drafter in service (no failed update reached it)",
            self.num_failed,
        )

    def _mark(self, now: float | None) -> Mark:
        return Mark(time.perf_counter() if now is None else now, self.tokens_total)

    def _extend_history(self, query: _Query, features: torch.Tensor, tokens: list[int]) -> None:
        """Append committed positions; emit a window of ``W + K`` positions whenever one is
        complete and keep its last ``K`` (the labels of the next window's first starts)."""
        query.features.append(features)
        query.tokens.extend(tokens)
        if len(query.tokens) < self.cfg.window + self.block_size:
            return
        stacked = torch.cat(query.features)
        windows, rest = cut_windows(
            stacked, torch.tensor(query.tokens), self.cfg.window, self.block_size
        )
        query.examples.extend(windows)
        query.features, query.tokens = [stacked[rest:]], query.tokens[rest:]
        del query.examples[: -self.cfg.max_examples_per_query]

    def _finish(self, query: _Query, now: float) -> None:
        tau = query.committed / max(query.verifies, 1)
        decision = self.bandit.end_query(query.signal, tau, self._mark(now), query.examples)
        if decision.rollback:
            self.copies.roll_back()
            logger.warning("SPECBLOCK adapt: acceptance length kept dropping; rolled back")
        elif decision.good:
            self.copies.mark_good()
        if decision.trigger is not None:
            trigger = decision.trigger
            if trigger.examples:
                self.trainer.submit(trigger.action, trigger.examples)
            else:  # routed queries too short to yield a window: nothing to train on
                self.bandit.on_failed()

    def summary(self) -> str:
        return self.bandit.summary()

    def close(self) -> None:
        self.trainer.close()


def request_keys(batch: Any) -> list[Hashable]:
    """Each request's id in ``batch``, the adapter's key for it (the request pool slots where
    a request has none)."""
    keys = [getattr(r, "rid", None) for r in getattr(batch, "reqs", None) or []]
    if len(keys) != batch.req_pool_indices.shape[0] or None in keys:
        return batch.req_pool_indices.tolist()
    return keys


__all__ = ["Action", "OnlineAdapter", "rejected_prob", "request_keys"]
