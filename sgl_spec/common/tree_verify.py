"""The one tree-verify call of SPECBLOCK and MINEDRAFT: pack the batch's draft trees (chains are
trees) and run SGLang's EAGLE verify on them (greedy longest matching path, or multi-candidate
rejection sampling over the tree: lossless either way).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_worker_common import run_eagle_verify

from sgl_spec.verify.packing import PackedTrees, pack_trees
from sgl_spec.verify.tree import DraftTree

# run_eagle_verify compacts the accepted path (KV, hidden states) to the front of each
# request's rows only for topk > 1; our trees are irregular, so ask for the compaction (for a
# chain it is the identity). Checked at start-up: patches/spec_internals.py.
_COMPACTING_TOPK = 2


@dataclass
class IrregularTreeVerifyInput(EagleVerifyInput):
    """SGLang's ``EagleVerifyInput`` for trees of any shape: SpecBlock's rank head shapes each
    tree and MineDraft's chains vary per request, so there is no fixed top-k per level;
    ``spec_steps`` is the depth bound."""

    @property
    def tree_topk(self) -> int:
        return -1  # irregular tree: the CPU backend then applies the custom mask


def verify_trees(
    worker: Any,  # a common.worker.TargetWrappingWorker
    batch: Any,  # ScheduleBatch in DECODE mode; its spec_info is replaced
    trees: list[DraftTree],  # one per request, rooted at its bonus token
    seq_lens: list[int],  # committed KV length per request
    width: int,  # verified nodes per request (trees are padded to it)
    depth_bound: int,
    capture_hidden: bool,
) -> tuple[GenerationBatchResult, PackedTrees]:
    """Verify ``trees`` in one target forward; returns SGLang's result and the packing."""
    packed = pack_trees(trees, seq_lens, width, int(worker.mask_mode()))
    dev = worker.device
    batch.spec_info = IrregularTreeVerifyInput(
        draft_token=packed.draft_tokens.to(dev),
        custom_mask=packed.custom_mask.to(dev),
        positions=packed.positions.to(dev),
        retrieve_index=packed.retrieve_index.to(dev),
        retrieve_next_token=packed.retrieve_next_token.to(dev),
        retrieve_next_sibling=packed.retrieve_next_sibling.to(dev),
        retrieve_cum_len=None,
        spec_steps=depth_bound,
        topk=-1,
        draft_token_num=width,
        capture_hidden_mode=CaptureHiddenMode.FULL if capture_hidden else CaptureHiddenMode.NULL,
        seq_lens_sum=None,
        seq_lens_cpu=None,
    )
    result = run_eagle_verify(
        batch,
        target_worker=worker._target_worker,
        req_to_token_pool=worker.model_runner.req_to_token_pool,
        token_to_kv_pool_allocator=worker.model_runner.token_to_kv_pool_allocator,
        plan_stream=None,
        plan_stream_ctx=contextlib.nullcontext(),
        topk=_COMPACTING_TOPK,
        num_draft_tokens=width,
        device=dev,
        metadata_ready_pre_pad=False,
        finalize_tree_path=True,
    )
    return result, packed
