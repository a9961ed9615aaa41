"""STANDALONE_FULL's draft worker: SGLang's ``StandaloneDraftWorker`` with the draft's KV
unshifted, so that the draft model reads the whole sequence.

Layout: the slot of position ``p`` holds the draft KV of token ``p``. The invariant between
rounds is EAGLE's, moved by one position: the draft KV covers every committed token *and* the
bonus token ``b`` (at position ``seq_len``), and the carried ``topk_p``/``topk_index`` are the
draft's proposals for the token after ``b``.

- prefill: the draft extends the prompt as is; the bonus token has no draft KV yet, so the
  request is marked and the next ``draft`` first runs one decode forward of the bonus tokens;
- ``draft``: EAGLE's draft loop with ``seq_lens`` one larger (drafts are written after ``b``);
- after verify: one extend per request of ``[root, accepted..., bonus, rejected...]`` (the
  verified root followed by the verify's outputs, ``num_draft_tokens + 1`` tokens at positions
  ``seq_len .. seq_len + num_draft_tokens``); the bonus row's logits propose the next draft.

The forward count per round is EAGLE's (one extend, ``num_steps - 1`` draft decodes), plus one
decode in the first round after a prefill. Slots past ``seq_len`` come from the decode
over-allocation (``2 * max(num_steps * topk, num_draft_tokens)`` per request), which holds the
``num_draft_tokens + 1`` window. Verify is SGLang's, untouched: the target checks every draft.

Each step is reported to sgl-spec's metrics (``sglang:spec_*`` series and the decode log line,
as our other algorithms do): the drafts accepted per request, the drafting time (``draft`` plus
the draft extend after verify) and the verify time between them. Reading the accept lengths
syncs with the device, so on a GPU this runs only with ``--enable-metrics``.
"""

from __future__ import annotations

import time

import torch
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative import standalone_worker_v2
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput
from sglang.srt.speculative.eagle_worker_common import (
    build_eagle_verify_input,
    prepare_for_draft,
    prepare_for_draft_extend,
)
from sglang.srt.speculative.spec_utils import renorm_draft_probs, sample_draft_proposal
from sglang.srt.utils.common import fast_topk

from sgl_spec.common.metrics import SpecMetrics
from sgl_spec.standalone import NAME, catch_up, hot_vocab
from sgl_spec.standalone.compiled import compile_forwards


def shift_seq_lens(batch: object, delta: int) -> None:
    """Move ``batch``'s sequence lengths (device, host mirror and sum) by ``delta``."""
    batch.seq_lens = batch.seq_lens + delta
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu + delta
    if getattr(batch, "seq_lens_sum", None) is not None:
        batch.seq_lens_sum = batch.seq_lens_sum + delta * len(batch.seq_lens)


def window_slots(
    req_to_token: torch.Tensor,  # [rows, max_context]
    req_pool_indices: torch.Tensor,  # [bs]
    start: torch.Tensor,  # [bs]
    width: int,
) -> torch.Tensor:
    """KV slots of positions ``start .. start + width - 1`` of each request, flat [bs * width]."""
    cols = start.to(torch.int64)[:, None] + torch.arange(width, device=start.device)
    return req_to_token[req_pool_indices.to(torch.int64)[:, None], cols].flatten().to(torch.int64)


# The upstream methods replaced below, with their parameters (checked before the hook installs).
REPLACED = {
    "_draft_extend_for_prefill": {
        "self", "batch", "target_hidden_states", "next_token_ids", "mm_input_embeds",
        "kv_loc_plan",
    },
    "draft": {"self", "batch", "with_topology"},
    "_draft_extend_for_decode": {"self", "batch", "batch_result", "kv_loc_plan"},
    "_capture_cuda_graphs": {"self"},
}  # fmt: skip


class FullContextDraftWorker(standalone_worker_v2.StandaloneDraftWorker):
    """SGLang's STANDALONE draft worker, the draft's KV unshifted (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # (start, end) of the last draft() awaiting its verify and draft extend
        self._draft_span: tuple[float, float] | None = None
        # seconds the last draft() spent reading tokens deferred by steps without drafts
        self.catch_up_s = 0.0
        server_args = self.server_args
        wanted = getattr(server_args, "enable_metrics", False) or str(
            server_args.device
        ).startswith("cpu")
        # labelled with our name, STANDALONE_FULL (SGLang serves it as STANDALONE)
        self.spec_metrics = SpecMetrics(NAME, server_args) if wanted else None
        self._forwards_compiled = False

    def init_lm_head(self) -> None:
        """SGLang's STANDALONE keeps the draft's own head; with ``--speculative-token-map`` it
        keeps only the map's rows (``hot_vocab.py``)."""
        super().init_lm_head()
        hot_vocab.install(self)

    def _capture_cuda_graphs(self) -> None:
        """SGLang's (no draft graphs on CPU), then our compiled forwards where the launch asked
        for them (``compiled.py``): here the pools and attention backends exist."""
        super()._capture_cuda_graphs()
        if not self._forwards_compiled:  # SGLang may call this again for a new runtime state
            self._forwards_compiled = True
            compile_forwards(self)

    def _propose(
        self,
        logits: torch.Tensor,  # [bs, vocab]
        sampling_info,
        positions: torch.Tensor,  # [bs] sampling-seed positions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Next-draft proposals from one row of draft logits per request, as EAGLE's
        ``_draft_extend_for_decode`` makes them: (topk_p [bs, topk], topk_index [bs, topk], q)."""
        if get_spec().speculative_use_rejection_sampling:
            probs, topk_p, topk_index = sample_draft_proposal(
                logits,
                sampling_info.temperatures,
                sampling_info.top_ks,
                sampling_seed=sampling_info.sampling_seed,
                positions=positions,
            )
            return topk_p, topk_index, probs
        if self.topk == 1:
            topk_index = torch.argmax(logits, dim=-1, keepdim=True)
            return torch.ones_like(topk_index, dtype=torch.float32), topk_index, None
        probs = renorm_draft_probs(logits, sampling_info, False)
        topk_p, topk_index = fast_topk(probs, self.topk, dim=-1)
        return topk_p, topk_index, None

    def _draft_extend_for_prefill(
        self,
        batch,
        target_hidden_states: torch.Tensor | None,
        next_token_ids: torch.Tensor,  # [bs] the target's first output token (the bonus)
        mm_input_embeds: torch.Tensor | None = None,
        kv_loc_plan=None,
    ) -> EagleDraftInput:
        """Extend the draft over the prompt tokens at their own positions (no shift)."""
        if mm_input_embeds is not None:
            raise NotImplementedError(
                "STANDALONE_FULL: multimodal inputs are not supported;"
                " launch with --speculative-algorithm STANDALONE (SGLang's layout)"
            )
        if not batch.forward_mode.is_idle():
            batch.spec_info = EagleDraftExtendInput(
                hidden_states=target_hidden_states,
                num_tokens_per_req=1,
                num_tokens_for_logprob_per_req=1,
            )
            forward_batch = ForwardBatch.init_new(
                batch,
                self.draft_runner,
                capture_hidden_mode=CaptureHiddenMode.NULL,
                return_hidden_states_before_norm=False,
                kv_loc_plan=kv_loc_plan,
            )
            forward_batch.return_logprob = False
            self.draft_runner.forward(forward_batch)
            for req in batch.reqs:
                catch_up.mark_fresh(req)
        # Placeholder proposals: the first draft() recomputes them from the bonus token.
        return self.placeholder_input(next_token_ids)

    def _draft_bonus(self, batch, draft_input: EagleDraftInput) -> None:
        """One draft decode of every request's bonus token at position ``seq_len``: writes its
        draft KV and replaces the carried proposals with the ones that follow it."""
        seq_lens = batch.seq_lens.to(torch.int64)  # [bs]
        seq_lens_cpu = (
            batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        ).to(torch.int64) + 1
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(seq_lens),
            input_ids=draft_input.bonus_tokens.to(torch.int64),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=seq_lens + 1,
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            out_cache_loc=window_slots(
                self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens, 1
            ),
            positions=seq_lens,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            spec_algorithm=self.draft_runner.spec_algorithm,
            return_hidden_states_before_norm=False,
            sampling_info=batch.sampling_info,
        )
        self.draft_runner.kv_index_translator.bind_own_plan(forward_batch)
        logits = self.draft_runner.forward(forward_batch).logits_output.next_token_logits
        topk_p, topk_index, probs = self._propose(logits, batch.sampling_info, seq_lens)
        draft_input.topk_p, draft_input.topk_index = topk_p, topk_index
        if probs is not None:
            draft_input.draft_probs = probs
        for req in batch.reqs:
            catch_up.mark_caught_up(req)

    def _catch_up(
        self, batch, seq_lens: torch.Tensor, bonus: torch.Tensor, draft_input: EagleDraftInput
    ) -> None:
        """The draft reads every request's deferred tokens and its ``bonus`` token (at
        ``seq_lens``) in one forward (``catch_up.py``); the proposals after the bonus token
        replace ``draft_input``'s."""
        seq_lens_list = seq_lens.tolist()
        logits = catch_up.catch_up_forward(
            self.draft_runner, batch.reqs, batch.req_pool_indices, seq_lens_list,
            bonus.to(torch.int64), batch.sampling_info,
        )  # fmt: skip
        topk_p, topk_index, probs = self._propose(logits, batch.sampling_info, seq_lens)
        draft_input.topk_p, draft_input.topk_index = topk_p, topk_index
        if probs is not None:
            draft_input.draft_probs = probs

    def placeholder_input(self, bonus_tokens: torch.Tensor) -> EagleDraftInput:
        """The state carried out of a prefill or a step without drafts (``control.py``): the
        bonus tokens, and proposals the next drafting step replaces from the bonus token's
        draft logits (``_draft_bonus``, ``_catch_up``)."""
        bs, device = len(bonus_tokens), bonus_tokens.device
        vocab = self.draft_runner.model_config.vocab_size
        return EagleDraftInput(
            topk_p=torch.ones((bs, self.topk), dtype=torch.float32, device=device),
            topk_index=torch.zeros((bs, self.topk), dtype=torch.int64, device=device),
            draft_probs=(
                torch.zeros((bs, vocab), dtype=torch.float32, device=device)
                if get_spec().speculative_use_rejection_sampling
                else None
            ),
            hidden_states=None,
            bonus_tokens=bonus_tokens,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )

    def _observe_step(self, accept_lens: torch.Tensor, extend_tic: float) -> None:
        """One step for the metrics: ``draft`` ran, then verify, then the draft extend (from
        ``extend_tic`` until now)."""
        span, metrics = self._draft_span, self.spec_metrics
        self._draft_span = None
        if span is None or metrics is None:
            return
        accepted = (accept_lens - 1).tolist()
        draft_s = span[1] - span[0] + time.perf_counter() - extend_tic
        offered = [self.speculative_num_steps] * len(accepted)  # draft depth per request
        metrics.observe_step(accepted, offered, draft_s, extend_tic - span[1])

    def draft(self, batch, *, with_topology: bool = False):
        """EAGLE's draft loop, run one position later: the bonus token is already in the draft's
        KV, so the drafts go to positions ``seq_len + 1 ...``. Verify sees the unshifted batch."""
        self.catch_up_s = 0.0
        if batch.forward_mode.is_idle():
            return super().draft(batch, with_topology=with_topology)
        tic = time.perf_counter()
        draft_input: EagleDraftInput = batch.spec_info
        if catch_up.any_behind(batch.reqs):  # after steps without drafts
            self._catch_up(batch, batch.seq_lens, draft_input.bonus_tokens, draft_input)
            self.catch_up_s = time.perf_counter() - tic
        elif catch_up.any_pending(batch.reqs):  # fresh from prefill: the bonus token alone
            self._draft_bonus(batch, draft_input)
        shift_seq_lens(batch, 1)
        try:
            forward_batch, _, _ = prepare_for_draft(
                draft_input,
                self.req_to_token_pool,
                batch,
                self.cuda_graph_runner,
                self.draft_runner,
                self.topk,
                self.speculative_num_steps,
                target_translator=None,  # the verify window is planned by verify itself
                num_draft_tokens=self.speculative_num_draft_tokens,
            )
            if self.speculative_num_steps > 1:
                self.draft_attn_backend.init_forward_metadata(forward_batch)
                forward_batch.mark_forward_metadata_ready()
            parent_list, top_scores_index, draft_tokens, draft_probs = self.draft_forward(
                forward_batch
            )
        finally:
            shift_seq_lens(batch, -1)
        if self.hot_token_id is not None:  # the verify reads q over the target's vocabulary
            vocab = self.target_worker.model_runner.model_config.vocab_size
            draft_probs = hot_vocab.full_vocab(draft_probs, self.hot_token_id, vocab)
        verify_input = build_eagle_verify_input(
            batch,
            draft_input,
            parent_list,
            top_scores_index,
            draft_tokens,
            draft_probs,
            target_worker=self.target_worker,
            topk=self.topk,
            num_steps=self.speculative_num_steps,
            num_draft_tokens=self.speculative_num_draft_tokens,
            tree_mask_mode=self.tree_mask_mode,
            device=self.device,
        )
        self._draft_span = (tic, time.perf_counter())
        if with_topology:
            return verify_input, parent_list, top_scores_index
        return verify_input

    def _draft_extend_for_decode(self, batch, batch_result, *, kv_loc_plan=None) -> None:
        """Extend the draft over ``[root, verify outputs]`` of each request: the accepted
        tokens, then the bonus (whose logits give the next proposals), then rejected tails that
        lie past the committed length and are overwritten later."""
        if batch.forward_mode.is_idle():
            return super()._draft_extend_for_decode(batch, batch_result, kv_loc_plan=kv_loc_plan)
        tic = time.perf_counter()
        num_draft_tokens = self.speculative_num_draft_tokens
        width = num_draft_tokens + 1
        bs = len(batch.seq_lens)
        roots = batch.spec_info.draft_token.view(bs, num_draft_tokens)[:, :1]  # [bs, 1]
        outputs = batch_result.next_token_ids.view(bs, num_draft_tokens)  # [bs, ndt]
        predict = torch.cat([roots.to(torch.int64), outputs.to(torch.int64)], dim=1).flatten()
        accept_lens = batch_result.accept_lens  # [bs] accepted drafts + 1 (the bonus)
        verify_out_cache_loc = batch.out_cache_loc
        batch.out_cache_loc = window_slots(
            self.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens, width
        )
        extend_input = EagleDraftExtendInput(
            hidden_states=None,
            num_correct_drafts=accept_lens - 1,
            num_accept_tokens=accept_lens,
            num_tokens_per_req=width,
            num_tokens_for_logprob_per_req=width,
        )
        forward_batch = prepare_for_draft_extend(
            extend_input,
            batch,
            predict,
            width,
            self.draft_runner,
            None,
            return_hidden_states_before_norm=False,
        )
        batch.out_cache_loc = verify_out_cache_loc
        logits = self.draft_runner.forward(forward_batch).logits_output.next_token_logits
        select = torch.arange(bs, device=logits.device) * width + accept_lens.to(torch.int64)
        topk_p, topk_index, probs = self._propose(
            logits[select], batch.sampling_info, batch_result.new_seq_lens
        )
        next_draft_input = batch_result.next_draft_input
        next_draft_input.topk_p, next_draft_input.topk_index = topk_p, topk_index
        next_draft_input.hidden_states = None
        if probs is not None:
            next_draft_input.draft_probs = probs
        self._observe_step(accept_lens, tic)
        next_draft_input.cuda_graph_compatible = True
