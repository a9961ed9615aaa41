"""A decode step without drafts, as a non-speculative server runs it, for our workers.

When a worker's controller turns speculation off for a step (MTP_LORA's k = 0, SPECBLOCK's node
budget 1), the step must cost what ``none``'s step costs: SGLang's DECODE forward of each
request's bonus token (decode attention, no tree mask, no verify bookkeeping), then the token
sampled as plain decoding samples it -- argmax when every request is greedy without logit
processing, else the chain verify with no drafts (penalties, logit bias, grammar, temperature,
top-k/top-p: ``verify_chain``). Also the chain verify MTP_LORA's drafted steps use, and the
``ForwardBatch`` both build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative import eagle_utils

from sgl_spec.common.sampling import needs_logit_processing, process_chain_logits
from sgl_spec.verify.chain import ChainResult, accept_greedy, accept_sampling


def forward_batch_of(
    worker: Any,  # a common.worker.TargetWrappingWorker
    batch: Any,  # the scheduler's ScheduleBatch (DECODE)
    mode: ForwardMode,
    input_ids: torch.Tensor,  # [bs, width] or [bs]
    positions: torch.Tensor,  # [bs * width]
    out_cache_loc: torch.Tensor,  # [bs, width] or [bs]
    spec_info: Any,  # the forward's spec input (None for DECODE)
    width: int,  # tokens per request
    new_lens: bool = False,  # seq_lens include this forward's tokens (decode's convention)
    capture_hidden: bool = False,  # keep every row's hidden states (FULL)
) -> ForwardBatch:
    """A ``ForwardBatch`` of ``width`` tokens per request of ``batch`` at the given slots."""
    seq_lens_cpu = batch.seq_lens_cpu
    bs = len(batch.reqs)
    forward_batch = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=input_ids.reshape(-1),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens + width if new_lens else batch.seq_lens,
        out_cache_loc=out_cache_loc.reshape(-1),
        seq_lens_sum=None if seq_lens_cpu is None else int(seq_lens_cpu.sum()) + width * bs,
        seq_lens_cpu=None if seq_lens_cpu is None else seq_lens_cpu + width,
        positions=positions,
        spec_algorithm=batch.spec_algorithm,
        spec_info=spec_info,
        capture_hidden_mode=CaptureHiddenMode.FULL if capture_hidden else CaptureHiddenMode.NULL,
        return_hidden_states_before_norm=False,
        sampling_info=batch.sampling_info,
    )
    worker.model_runner.kv_index_translator.bind_own_plan(forward_batch)
    return forward_batch


def verify_chain(
    batch: Any,
    drafts: torch.Tensor,  # [bs, k] (k may be 0)
    anchor0: torch.Tensor,  # [bs] the verified token the chain starts from
    logits: torch.Tensor,  # [bs, k+1, vocab] the target's logits after each anchor
) -> ChainResult:
    """Lossless acceptance of one chain of drafts per request under its sampling options;
    ``logits`` get the penalties, logit bias and grammar mask in place."""
    info = batch.sampling_info
    bs, width, vocab = logits.shape
    flat = logits.view(bs * width, vocab)
    candidates = torch.cat((anchor0[:, None], drafts), dim=1)
    process_chain_logits(batch, flat, candidates)  # penalties, logit_bias, grammar
    if info.is_all_greedy:
        return accept_greedy(drafts, torch.argmax(logits, dim=-1))
    temperatures = torch.repeat_interleave(info.temperatures, width, dim=0)
    probs = eagle_utils.sampling_softmax(flat, temperatures=temperatures)
    if info.need_top_k_sampling:
        probs = eagle_utils.top_k_renorm_prob(
            probs, torch.repeat_interleave(info.top_ks, width, dim=0)
        )
    if info.need_top_p_sampling:
        probs = eagle_utils.top_p_renorm_prob(
            probs, torch.repeat_interleave(info.top_ps, width, dim=0)
        )
    coins, final_coins = eagle_utils._verify_coins(
        sampling_info=info,
        seq_lens=batch.seq_lens,
        draft_token_num=width,
        candidates=candidates,
        device=drafts.device,
    )
    sampler = eagle_utils.tree_speculative_sampling_target_only
    if sampler is None:
        raise RuntimeError("no speculative sampling kernel on this platform")
    return accept_sampling(
        drafts, anchor0, probs.view(bs, width, vocab), coins, final_coins, sampler
    )


@dataclass
class PlainStep:
    tokens: torch.Tensor  # [bs] the token each request committed after its bonus token
    logits_output: Any  # the forward's LogitsProcessorOutput (hidden states taken out)
    hidden: torch.Tensor | None  # [bs, ...] the bonus tokens' hidden states, if captured
    can_run_cuda_graph: bool
    locs: torch.Tensor  # [bs] the target KV slot each bonus token was written to (int64)


def plain_step(
    worker: Any, batch: Any, bonus: torch.Tensor, capture_hidden: bool = False
) -> PlainStep:
    """The DECODE forward of each request's ``bonus`` token ([bs], at position ``seq_len``,
    into its KV slot there) and the next token sampled; syncs with the device at the end, so
    that a caller timing the step times its work."""
    bs = len(batch.reqs)
    bonus = bonus.to(torch.int64)
    seq_lens = batch.seq_lens.to(torch.int64)  # the bonus token's position and KV slot
    req_to_token = worker.model_runner.req_to_token_pool.req_to_token
    out_cache_loc = req_to_token[batch.req_pool_indices.to(torch.int64), seq_lens].long()
    forward_batch = forward_batch_of(
        worker, batch, ForwardMode.DECODE, bonus, seq_lens, out_cache_loc, None, 1,
        new_lens=True, capture_hidden=capture_hidden,
    )  # fmt: skip
    out = worker._target_worker.forward_batch_generation(
        batch=None, forward_batch=forward_batch, is_verify=True
    )
    logits_output = out.logits_output
    hidden = logits_output.hidden_states
    logits_output.hidden_states = None
    if batch.sampling_info.is_all_greedy and not needs_logit_processing(batch):
        tokens = torch.argmax(logits_output.next_token_logits, dim=-1)
    else:  # the general path: penalties and sampling exactly as in a drafted step
        logits = logits_output.next_token_logits.view(bs, 1, -1).clone()
        tokens = verify_chain(batch, bonus.new_zeros((bs, 0)), bonus, logits).bonus
        logits_output.next_token_logits = logits.view(bs, -1)
    if batch.return_logprob:
        compute_spec_logprobs(batch, logits_output, tokens, chain_stride=1)
    tokens.tolist()  # host sync: the step's work is done before it is timed
    return PlainStep(tokens, logits_output, hidden, bool(out.can_run_cuda_graph), out_cache_loc)


def plain_result(batch: Any, step: PlainStep, next_draft_input: Any) -> GenerationBatchResult:
    """SGLang's result of a plain step: one token per request, no drafts."""
    new_seq_lens = batch.seq_lens + 1
    return GenerationBatchResult(
        logits_output=step.logits_output,
        next_token_ids=step.tokens.to(torch.int32),
        accept_lens=torch.ones_like(batch.seq_lens, dtype=torch.int32),
        next_draft_input=next_draft_input,
        speculative_num_draft_tokens=1,
        speculative_output_stride=1,
        num_non_draft_tokens_per_req=1,
        new_seq_lens=new_seq_lens,
        can_run_cuda_graph=step.can_run_cuda_graph,
    )
