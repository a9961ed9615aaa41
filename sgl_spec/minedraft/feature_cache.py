"""The target's (low, mid, top) features kept for a SpecBlock drafter hosted by the draft server.

With ``--minedraft-drafter specblock`` the drafter conditions on the target's features
(``specblock_host.py``). Prefill and verify capture them as SPECBLOCK does; this cache keeps one
row per target KV location, written when that location's KV is, and each request's draft job
reads the rows of its new positions through its ``req_to_token`` row, so radix-cache hits and
requests re-sent after a draft-server restart find theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)


class TargetFeatureCache:
    """Feature rows of the tokens at each target KV location (allocated on first use)."""

    def __init__(self, model_runner, feature_index: torch.Tensor, device) -> None:
        self.model_runner = model_runner
        # column index of the features in SGLang's captured hidden states
        self.feature_index = feature_index
        self.device = device
        self._pool: torch.Tensor | None = None

    @property
    def pool(self) -> torch.Tensor:
        """``[locations, 3 * d_target]``: the features of the token at each target KV location,
        written when its KV is (prefill, verify). A request's rows are the locations of its
        ``req_to_token`` row, so radix-cache hits and re-sent requests find theirs; SGLang's KV
        budget counts these bytes (``patches/worker_kv_budget.py``)."""
        if self._pool is None:
            kv_pool = self.model_runner.token_to_kv_pool
            rows = int(kv_pool.size) + int(getattr(kv_pool, "page_size", 1)) + 1
            self._pool = torch.zeros(
                rows, int(self.feature_index.numel()), dtype=self.model_runner.dtype,
                device=self.device,
            )  # fmt: skip
            logger.info(
                "MINEDRAFT: target feature cache %.1f MiB",
                self._pool.numel() * self._pool.element_size() / 2**20,
            )
        return self._pool

    def store(self, locs: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Features of the tokens whose KV was just written at ``locs`` (rows of ``hidden``)."""
        if hidden is None or locs.numel() == 0:
            return
        rows = hidden.index_select(-1, self.feature_index).to(self.pool.dtype)
        self.pool[locs.to(torch.long)] = rows

    def store_accepted(
        self,
        hidden: torch.Tensor | None,  # [bs * width, ...] captured by the verify forward
        pool_indices: list[int],
        seq_lens: list[int],  # before the verify
        accept: list[int],  # accepted tokens per request (root + accepted drafts)
        width: int,
    ) -> None:
        """After a verify: the accepted path (root + accepted drafts) is compacted to the front
        of each request's rows and of its step slots; those tokens now have KV and features."""
        if hidden is None:
            return
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        for i, (n, pool_index) in enumerate(zip(accept, pool_indices, strict=True)):
            locs = req_to_token[pool_index, seq_lens[i] : seq_lens[i] + n]
            self.store(locs, hidden[i * width : i * width + n])

    def rows(self, req_pool_index: int) -> Callable[[int, int], np.ndarray]:
        """Rows of positions ``start .. end-1`` of a request, read when its job is sent."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token

        def read(start: int, end: int) -> np.ndarray:
            locs = req_to_token[req_pool_index, start:end].to(torch.long)
            return self.pool[locs].float().cpu().numpy()

        return read
