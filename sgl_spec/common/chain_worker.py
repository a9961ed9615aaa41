"""The smallest whole speculative worker: each request drafts a chain of tokens from its own
sequence, the target verifies every chain in one forward (``tree_verify.verify_trees``, greedy
longest matching prefix or rejection sampling: lossless whatever the drafts).

A subclass brings ``draft(tokens, max_drafts)``; prefill, the state carried between steps,
verification and the ``sglang:spec_*`` metrics are here. An algorithm whose drafts come from
a model, a cache or a lookup table, one request at a time, needs nothing else from SGLang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sgl_spec.common.draft_input import CarriedDraftInput
from sgl_spec.common.tree_verify import verify_trees
from sgl_spec.common.worker import TargetWrappingWorker
from sgl_spec.verify.tree import DraftTree


class ChainDraftWorker(TargetWrappingWorker):
    """Drafts up to ``num_steps`` tokens per request per step; verifies them as chains."""

    def __init__(
        self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any, settings: Any
    ) -> None:
        del gpu_id, nccl_port
        super().__init__(server_args, target_worker)
        self.settings = settings
        self.num_steps = self.chain_length(settings)
        self.set_verify_shape(self.num_steps, self.num_steps + 1)

    def chain_length(self, settings: Any) -> int:
        """The most drafts per request and step (the algorithm's ``verify_shape`` agrees)."""
        raise NotImplementedError

    def draft(self, tokens: Sequence[int], max_drafts: int) -> Sequence[int]:
        """Up to ``max_drafts`` tokens continuing ``tokens`` (the request's whole sequence,
        prompt and output; its last token is verified and has no KV yet)."""
        raise NotImplementedError

    def forward_prefill(self, batch: Any) -> Any:
        return self.prefill_target(batch, CarriedDraftInput.carried)

    def forward_decode(self, batch: Any) -> Any:
        tic = time.perf_counter()
        roots = batch.spec_info.bonus_tokens.tolist()
        trees = []
        for req, root in zip(batch.reqs, roots, strict=True):
            tokens = [*req.origin_input_ids, *req.output_ids]
            drafts = list(self.draft(tokens, self.num_steps))[: self.num_steps]
            trees.append(DraftTree.chain(int(root), drafts))
        verify_tic = time.perf_counter()
        width = self.num_steps + 1
        seq_lens = batch.seq_lens.tolist()
        result, _ = verify_trees(self, batch, trees, seq_lens, width, self.num_steps, False)
        result.next_draft_input = CarriedDraftInput.carried(
            result.next_draft_input.bonus_tokens, result.new_seq_lens
        )
        accept = result.accept_lens.tolist()
        self.metrics.observe_step(
            [a - 1 for a in accept],
            [tree.num_nodes - 1 for tree in trees],
            verify_tic - tic,
            time.perf_counter() - verify_tic,
        )
        return result
