"""SPECBLOCK's drafter kept in step with the committed tokens: its KV cache (one row per
location of the target's KV pool), the extend forward over newly committed tokens (training's
pass 1), and -- with node budgets that run steps without drafts -- the tokens it has not read
yet, kept per location (``target_rows.py``) and read in one extend before the next step that
drafts for them. A mixin of ``worker.SpecBlockWorker``, which holds the drafter and the target.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sgl_spec.specblock.draft_kv import DrafterKVPool, drafter_kv_shape
from sgl_spec.specblock.drafting import PrefixContext, extend_prefix
from sgl_spec.specblock.target_rows import TargetRows, locations

logger = logging.getLogger(__name__)
EXTEND_CHUNK = 256  # positions per drafter extend forward (bounds the [S*K, C+S*K] mask)
# Query-key pairs one catch-up forward may hold across its requests (its attention scores are
# this many per head): a catch-up after a long stretch without drafts reads many positions of
# many requests, so it runs in groups of requests.
CATCH_UP_PAIRS = 1 << 22


class DrafterFollowing:
    """Needs ``drafter``, ``drafter_dtype``, ``device``, ``model_runner``, ``feature_index``
    and ``_pool`` (None until first used) on the worker."""

    drafter: torch.nn.Module
    drafter_dtype: torch.dtype
    device: object
    model_runner: object
    feature_index: torch.Tensor
    _pool: DrafterKVPool | None
    _rows: TargetRows | None  # None: every committed token is read at once (no plain steps)
    _features_in_order: bool | None = None  # feature_index is 0..F-1 (known on first use)

    @property
    def pool(self) -> DrafterKVPool:
        """One drafter row per location of the target's KV pool (created after this worker)."""
        if self._pool is None:
            num_layers, block_size, heads, head_dim = drafter_kv_shape(self.drafter.config)
            self._pool = DrafterKVPool(
                num_layers=num_layers,
                num_rows=self._pool_rows(),
                block_size=block_size,
                num_kv_heads=heads,
                head_dim=head_dim,
                dtype=self.drafter_dtype,
                device=self.device,
            )
            logger.info("SPECBLOCK: drafter KV cache %.1f MiB", self._pool.nbytes() / 2**20)
        return self._pool

    def _pool_rows(self) -> int:
        kv_pool = self.model_runner.token_to_kv_pool
        return int(kv_pool.size) + int(getattr(kv_pool, "page_size", 1)) + 1

    def _ensure_rows(self) -> TargetRows:
        """The unread tokens' rows (created on first use, as the pool)."""
        if self._rows is None:
            width = int(self.feature_index.shape[0])
            self._rows = TargetRows(self._pool_rows(), width, self.drafter_dtype, self.device)
            logger.info("SPECBLOCK: unread-token rows %.1f MiB", self._rows.nbytes() / 2**20)
        return self._rows

    def _features(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [n, 3*d_target]
        if self._features_in_order is None:  # each layer captured once, in order: no select
            index = self.feature_index
            in_order = torch.arange(hidden_states.shape[-1], device=index.device)
            self._features_in_order = torch.equal(index, in_order)
        if self._features_in_order:
            return hidden_states.to(self.drafter_dtype)
        return hidden_states.index_select(-1, self.feature_index).to(self.drafter_dtype)

    def _no_pending(self, bs: int) -> dict:
        return {"pending_count": torch.zeros(bs, dtype=torch.int64, device=self.device)}

    def _drafter_extend(
        self,
        req_pool_indices: torch.Tensor,  # [bs]
        prefix_lens: torch.Tensor,  # [bs] tokens before the new ones (drafter context)
        num_new: torch.Tensor,  # [bs] new processed tokens per request (>= 1)
        hidden: torch.Tensor | None,  # [rows, captured layers * d_target] the target's aux states
        tokens: torch.Tensor,  # [rows]
        row_starts: torch.Tensor,  # [bs] first row of each request in features / tokens
        context: PrefixContext | None = None,  # already gathered for prefix_lens
        features: torch.Tensor | None = None,  # [rows, F] instead of ``hidden``'s
        store_rows: bool = False,  # keep the new positions' rows (``target_rows``) too
    ) -> torch.Tensor:  # [bs, d] next root condition
        """Training's pass 1 over the new positions; a failure leaves a zero condition (poor
        drafts next step, never a wrong output) and is logged."""
        try:
            if features is None:
                features = self._features(hidden)
            return self._drafter_extend_chunks(
                req_pool_indices, prefix_lens, num_new, features, tokens, row_starts, context,
                store_rows,
            )  # fmt: skip
        except Exception:
            logger.exception("SPECBLOCK: drafter extend failed; next drafts are uninformed")
            return torch.zeros(
                req_pool_indices.shape[0],
                self.drafter.config.hidden_size,
                dtype=self.drafter_dtype,
                device=self.device,
            )

    def _drafter_extend_chunks(
        self,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        num_new: torch.Tensor,
        features: torch.Tensor,
        tokens: torch.Tensor,
        row_starts: torch.Tensor,
        context: PrefixContext | None,
        store_rows: bool = False,
    ) -> torch.Tensor:
        """Pass 1 in chunks of ``EXTEND_CHUNK`` positions; writes the drafter KV cache (and
        with ``store_rows`` first keeps the positions' rows, at the same locations)."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        reqs = req_pool_indices.to(torch.long)
        bs = reqs.shape[0]
        root_cond = torch.zeros(
            bs, self.drafter.config.hidden_size, dtype=self.drafter_dtype, device=self.device
        )
        max_new = int(num_new.max()) if bs else 0
        for offset in range(0, max_new, EXTEND_CHUNK):
            count = (num_new - offset).clamp(min=0, max=EXTEND_CHUNK)  # [bs]
            active = count > 0
            s = int(count.max())
            cols = torch.arange(s, device=self.device)
            valid = cols[None, :] < count[:, None]  # [bs, s]
            rows = (row_starts[:, None] + offset + cols[None, :]).clamp(max=tokens.shape[0] - 1)
            positions = prefix_lens[:, None] + offset + cols[None, :]
            context_len = prefix_lens + offset
            if offset == 0 and context is not None:  # the drafting's rows, all slots visible
                prefix = self.pool.with_visibility(context, context_len, last_slot_only=False)
            else:
                prefix = self._gather_context(reqs, context_len, last_slot_only=False)
            locs = req_to_token[reqs[:, None], positions.clamp(max=req_to_token.shape[1] - 1)]
            keep = torch.nonzero(valid.reshape(-1)).squeeze(1)
            kept_locs = locs.reshape(-1)[keep]
            if store_rows:
                kept_rows = rows.reshape(-1)[keep]
                self._ensure_rows().store(kept_locs, features[kept_rows], tokens[kept_rows])
            out = extend_prefix(
                self.drafter,
                prefix,
                features[rows],
                torch.where(valid, tokens[rows], 0),
                positions,
                count.clamp(min=1),
            )
            self.pool.write(kept_locs, out.kv, keep)
            if self._rows is not None:
                self._rows.mark_read(kept_locs)
            is_last = active & (num_new <= offset + EXTEND_CHUNK)
            root_cond[is_last] = out.root_cond[is_last].to(root_cond.dtype)
        return root_cond

    def _gather_context(self, reqs: torch.Tensor, num_tokens: torch.Tensor, last_slot_only: bool):
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        t = max(int(num_tokens.max()), 1)
        cols = torch.arange(t, device=self.device)
        locs = req_to_token[reqs[:, None], cols[None, :]]
        locs = torch.where(cols[None, :] < num_tokens[:, None], locs, 0)
        return self.pool.gather(locs, num_tokens, last_slot_only)

    def _follow(
        self,
        reqs: torch.Tensor,  # [bs]
        seq_lens: torch.Tensor,  # [bs] committed before this step
        accept_lens: torch.Tensor,  # [bs] accepted drafts + 1
        hidden: torch.Tensor,  # [bs * width, ...] target features, accepted path first
        path_tokens: torch.Tensor,  # [bs, width] accepted path tokens, root first
        context: PrefixContext | None = None,  # the drafting's context, if it drafted
        deferred: Any = None,  # the step's SpecBlockDraftInput: read later (``_defer_follow``)
    ) -> dict:
        """After a drafting step's verify: the drafter reads the committed tokens (one extend).
        Returns the drafter fields of the next ``SpecBlockDraftInput``."""
        if deferred is not None:
            return self._defer_follow(reqs, seq_lens, accept_lens, hidden, path_tokens, deferred)
        bs, width = path_tokens.shape
        features = self._features(hidden[: bs * width])
        carried = self._no_pending(bs)
        carried["root_cond"] = self._drafter_extend(
            reqs,
            seq_lens,
            accept_lens,
            None,
            path_tokens.reshape(-1),
            torch.arange(bs, device=self.device) * width,
            context,
            features=features,
            # kept where steps may run without drafts, so that a radix-cache hit re-reads them
            store_rows=self._rows is not None,
        )
        return carried

    def _defer_follow(
        self,
        reqs: torch.Tensor,  # [bs]
        seq_lens: torch.Tensor,  # [bs] committed before this step
        accept_lens: torch.Tensor,  # [bs] accepted drafts + 1
        hidden: torch.Tensor,  # [bs * width, ...] target features, accepted path first
        path_tokens: torch.Tensor,  # [bs, width] accepted path tokens, root first
        state: Any,  # the step's SpecBlockDraftInput (the drafter's unread tokens before it)
    ) -> dict:
        """After a verify of trees the drafter did not grow (``ngram_branch``): the accepted
        tokens' rows are kept, and the next step that drafts reads them with the others unread
        (``_catch_up``), instead of an extend now. Returns the next input's drafter fields."""
        bs, width = path_tokens.shape
        keep = torch.arange(width, device=self.device)[None, :] < accept_lens[:, None]
        rows = self._features(hidden[: bs * width][keep.reshape(-1)])
        self._store_committed(reqs, seq_lens, accept_lens, rows, path_tokens[keep])
        pending = state.pending_count.to(torch.int64) + accept_lens.to(torch.int64)
        return {"root_cond": state.root_cond, "pending_count": pending}

    def _store_committed(
        self,
        reqs: torch.Tensor,  # [bs]
        committed: torch.Tensor,  # [bs] committed tokens before these
        num_new: torch.Tensor,  # [bs] tokens committed by this forward (>= 1)
        features: torch.Tensor,  # [rows, F] their target features, request after request
        tokens: torch.Tensor,  # [rows]
    ) -> None:
        """Keep the rows of tokens a forward committed (a prefill, a step without drafts, a
        verify's accepted path), not read by the drafter yet."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        locs, valid = locations(req_to_token, reqs, committed, num_new)
        self._ensure_rows().store(locs[valid], features, tokens)

    def _catch_up(
        self,
        reqs: torch.Tensor,  # [bs]
        committed: torch.Tensor,  # [bs] committed tokens, the unread ones included
        count: torch.Tensor,  # [bs] unread tokens per request (the last ``count`` positions)
        root_cond: torch.Tensor,  # [bs, d] the condition before them
    ) -> torch.Tensor:
        """The drafter reads each request's unread tokens from their rows (``target_rows``),
        in groups of requests whose extend fits ``CATCH_UP_PAIRS``; returns the root
        condition they lead to (``root_cond`` where there were none)."""
        todo = torch.nonzero(count > 0).squeeze(1)
        if todo.numel() == 0:
            return root_cond
        out = root_cond.clone()
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        k = self.drafter.config.block_size
        for group in _groups(todo, count, committed, k):
            n, ends = count[group], committed[group]
            features, tokens = self._rows.rows(req_to_token, reqs[group], ends - n, n)
            width = tokens.shape[1]
            cond = self._drafter_extend(
                reqs[group], ends - n, n, None, tokens.reshape(-1),
                torch.arange(group.numel(), device=self.device) * width,
                features=features.reshape(group.numel() * width, -1),
            )  # fmt: skip
            out[group] = cond.to(out.dtype)
        return out


def _groups(todo: torch.Tensor, count: torch.Tensor, committed: torch.Tensor, k: int):
    """``todo`` (request indices) in consecutive groups, each of whose catch-up forward holds at
    most ``CATCH_UP_PAIRS`` query-key pairs (at least one request per group)."""
    s = count[todo].clamp(max=EXTEND_CHUNK) * k  # query rows per chunk
    pairs = (s * (committed[todo] * k + s)).tolist()  # keys: K slots per context position
    group: list[int] = []
    total = 0
    for index, cost in zip(todo.tolist(), pairs, strict=True):
        if group and total + cost > CATCH_UP_PAIRS:
            yield torch.tensor(group, dtype=torch.long, device=todo.device)
            group, total = [], 0
        group.append(index)
        total += cost
    if group:
        yield torch.tensor(group, dtype=torch.long, device=todo.device)
