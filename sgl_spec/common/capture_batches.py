"""The synthetic batches ``compiled_forwards`` captures its graphs on: one per ``Shape``, reading
and writing only the pools' reserved row and slot 0, laid out as SGLang lays out the forward
that shape stands for (a decode, a chain or tree verify, a draft extend, a draft loop's step).
A shape is a ``compiled_forwards.Shape`` (not imported: that module imports this one)."""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo


class _CaptureVerify:
    """The ``spec_info`` a capture's verify batch carries: what the CPU attention backend reads
    to plan a verify of ``draft_token_num`` tokens a request: a chain (top-k 1, the kernel's
    causal mask) or a tree (top-k -1, irregular: the custom mask, here all visible)."""

    def __init__(self, shape: Any, prefix: int) -> None:
        self.draft_token_num = shape.tokens
        self.tree_topk = -1 if shape.tree else 1
        self.custom_mask = None
        if shape.tree:
            n = shape.tokens
            self.custom_mask = torch.ones(shape.batch_size * n * (prefix + n), dtype=torch.bool)
            torch._dynamo.mark_dynamic(self.custom_mask, 0)  # as long as the requests are


def capture_batch(model_runner: Any, shape: Any) -> Any:
    """A batch of ``shape`` that reads and writes only the pools' reserved row and slot 0."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    bs, num = shape.batch_size, shape.batch_size * shape.tokens
    mode = ForwardMode[shape.mode]
    prefix = torch.ones(bs, dtype=torch.int64)  # one cached token: slot 0
    seq_lens = prefix + 1 if mode == ForwardMode.DECODE else prefix
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(num, dtype=torch.int64),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=int(seq_lens.sum()),
        out_cache_loc=torch.zeros(num, dtype=torch.int64),
        positions=torch.zeros(num, dtype=torch.int64),
        spec_algorithm=model_runner.spec_algorithm,
        spec_info=_CaptureVerify(shape, 1) if mode == ForwardMode.TARGET_VERIFY else None,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        return_hidden_states_before_norm=False,
    )
    if mode == ForwardMode.DRAFT_EXTEND_V2:
        _as_extend(model_runner, fb, prefix, shape.tokens)
    model_runner.kv_index_translator.bind_own_plan(fb)
    return fb


def _as_extend(model_runner: Any, fb: Any, prefix: torch.Tensor, n: int) -> None:
    """``fb``, an extend of ``n`` tokens a request after ``prefix``, laid out as SGLang's
    ``ForwardBatch.init_new`` lays out a draft extend."""
    from sglang.srt.model_executor.forward_batch_info import compute_position

    bs = fb.batch_size
    fb.extend_seq_lens = torch.full((bs,), n, dtype=torch.int32)
    fb.extend_prefix_lens = prefix.to(torch.int32)
    fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = [n] * bs, prefix.tolist()
    fb.extend_num_tokens = bs * n
    fb.positions, fb.extend_start_loc = compute_position(
        model_runner.prefill_attention_backend_str, fb.extend_prefix_lens, fb.extend_seq_lens,
        fb.extend_num_tokens,
    )  # fmt: skip
    fb.seq_lens = prefix + n
    fb.seq_lens_cpu, fb.seq_lens_sum = fb.seq_lens.clone(), int(fb.seq_lens.sum())


def draft_step_metadata(backend: Any, fb: Any) -> tuple:
    """What SGLang's multi-step draft backend gives one step's backend: a slot table with a row
    per request, the lengths, the rows (here all slot 0)."""
    req_to_token = backend.req_to_token_pool.req_to_token
    rows = torch.zeros((fb.batch_size, req_to_token.shape[1]), dtype=req_to_token.dtype)
    return rows, fb.seq_lens.clone(), torch.arange(fb.batch_size, dtype=torch.int64)
