"""MTP_LORA worker: draft and verify in one target forward per step (paper §4.3).

Each decode step feeds, per request, k+1 anchors -- the bonus token of the previous step and the
k drafts the masks proposed -- each followed by k mask tokens: (k+1)² tokens in SGLang's
TARGET_VERIFY mode with a custom attention mask (``sgl_spec/mtp/layout.py``). Anchors run the base
weights (gate 0) and verify the drafts; masks run the gated LoRA (gate 1) and, after the last
accepted anchor, provide the next k drafts. Anchors occupy the first k+1 KV slots of the step, so
the accepted ones are already the committed prefix; mask KV lies past the committed length and is
overwritten by the next step (SGLang's spec-v2 allocator reserves that room per step).

Prefill is SGLang's plain target extend; the first decode step therefore has no drafts to verify
(its drafts are placeholders that verification rejects), only masks to draft from.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
)

from sgl_spec.common import compiled_forwards
from sgl_spec.common.metrics import count_controller_failures
from sgl_spec.common.plain_step import forward_batch_of, plain_result, plain_step, verify_chain
from sgl_spec.common.worker import TargetWrappingWorker
from sgl_spec.control.guard import served_controller
from sgl_spec.mtp import layout as mtp_layout_mod
from sgl_spec.mtp.info import MtpDraftInput, MtpForwardInput, pad_drafts
from sgl_spec.mtp.settings import MtpSettings
from sgl_spec.mtp.sglang_lora import GatedLoRA, install_gated_lora

logger = logging.getLogger(__name__)
LOG_EVERY_STEPS = 200
# Debugging aid: with SGLSPEC_MTP_TRACE=FILE every decode step appends one line
# "start_time k batch_size step_ms decision" (the controller's view of the step).
TRACE_ENV = "SGLSPEC_MTP_TRACE"


@dataclass
class MtpStats:
    """Running counters, logged every ``LOG_EVERY_STEPS`` decode steps."""

    steps: int = 0
    requests: int = 0
    accepted: int = 0
    drafted: int = 0
    forward_s: float = 0.0
    k_histogram: dict[int, int] = field(default_factory=dict)
    last_decision: object | None = None  # the controller's latest Decision, if any

    def record(self, k: int, bs: int, num_accepted: int, seconds: float) -> None:
        self.steps += 1
        self.requests += bs
        self.accepted += num_accepted
        self.drafted += k * bs
        self.forward_s += seconds
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1

    def summary(self) -> str:
        accept_len = 1 + self.accepted / max(self.requests, 1)
        rate = self.accepted / max(self.drafted, 1)
        return (
            f"MTP_LORA: steps={self.steps} mean_accept_length={accept_len:.3f} "
            f"draft_accept_rate={rate:.3f} k_histogram={dict(sorted(self.k_histogram.items()))} "
            f"mean_step_forward_ms={1000 * self.forward_s / max(self.steps, 1):.2f}"
            f" last_decision={self.last_decision}"
        )


class MtpLoraWorker(TargetWrappingWorker):
    """Single-model speculative worker; the target's own runner and KV pool do everything."""

    name = "MTP_LORA"

    def __init__(
        self, server_args, gpu_id: int, nccl_port: int, target_worker, settings: MtpSettings
    ) -> None:
        super().__init__(server_args, target_worker)
        self.lora: GatedLoRA = install_gated_lora(
            self.model_runner.model,
            settings.adapter_path,
            self.model_runner.model_config.hf_config,
            dtype=self.model_runner.dtype,
            device=torch.device(self.device),
        )
        self.k_max = settings.k_max
        self.fixed_k = settings.fixed_k
        self.controller = served_controller(settings.controller)
        count_controller_failures(self.controller, self.metrics)
        self.mask_token_ids = torch.tensor(settings.mask_token_ids, device=self.device)
        self._layouts: dict[int, tuple] = {}
        self.stats = MtpStats()
        trace = os.environ.get(TRACE_ENV)
        self._trace = open(trace, "a", buffering=1) if trace else None
        self.set_verify_shape(self.k_max, (self.k_max + 1) ** 2)

    def forward_prefill(self, batch) -> GenerationBatchResult:
        return self.prefill_target(batch, MtpDraftInput.after_prefill)

    # ---- compiled forwards (--enable-torch-compile) ------------------------------------------

    def compiled_shapes(self, batch_sizes: list[int]) -> list[compiled_forwards.Shape]:
        """The step of every k the worker may run: k > 0 a tree verify of (k+1)² tokens a
        request, k = 0 the plain decode."""
        ks = range(self.k_max + 1) if self.controller is not None else [self.fixed_k]
        widths = [(k + 1) ** 2 for k in ks if k > 0]
        return compiled_forwards.forward_shapes(batch_sizes, widths, 0 in ks, tree=True)

    def compiled_state(self, shape: compiled_forwards.Shape) -> contextlib.AbstractContextManager:
        """A verify of (k+1)² tokens a request runs with its mask rows gated, as
        ``forward_decode`` gates them (its graph fixes the gate); a decode has none."""
        if shape.mode != "TARGET_VERIFY":
            return contextlib.nullcontext()
        return self._gates(math.isqrt(shape.tokens) - 1)

    def _gates(self, k: int) -> contextlib.AbstractContextManager:
        """k's step with its mask rows gated: rows k+1.. of every (k+1)²-token block on the
        LoRA path (the one gate both a step and its compiled verify's capture use)."""
        lay, _, mask_index, _ = self._layout(k)
        return self.lora.gates(lay.width, k + 1, mask_index)

    # ---- decode step -------------------------------------------------------------------------

    def _choose_k(self, batch) -> int:
        if self.controller is None:
            return self.fixed_k
        ctx = int(batch.seq_lens_cpu.float().mean()) if batch.seq_lens_cpu is not None else 0
        decision = self.controller.decide(len(batch.reqs), ctx)
        self.stats.last_decision = decision
        self.step_chosen(decision.k, len(batch.reqs))
        return min(decision.k, self.k_max)

    def _layout(self, k: int) -> tuple:
        """Cached device tensors of the step layout for k drafts."""
        if k not in self._layouts:
            lay = mtp_layout_mod.mtp_layout(k).to(self.device)
            # The gate is the contiguous tail of each request's block (layout contract).
            if not bool(lay.is_mask[k + 1 :].all()) or bool(lay.is_mask[: k + 1].any()):
                raise RuntimeError("MTP_LORA: layout must put the k+1 anchors first")
            group_slots = torch.stack([lay.mask_slots(i) for i in range(k + 1)])
            self._layouts[k] = (
                lay,
                lay.position_offsets.to(torch.int64),
                lay.mask_index[k + 1 :].to(torch.int64),
                group_slots.to(torch.int64).reshape(k + 1, k),
            )
        return self._layouts[k]

    def forward_decode(self, batch) -> GenerationBatchResult:
        # The controller compares whole steps: input layout, mask and batch construction differ
        # between k = 0 and k > 0 as much as the forward does.
        tic = time.perf_counter()
        state: MtpDraftInput = batch.spec_info
        bs = len(batch.reqs)
        self.step_started(batch, tic)
        k = self._choose_k(batch)
        if k == 0:
            return self._forward_plain(batch, state, tic)
        lay, offsets, _, group_slots = self._layout(k)
        width = lay.width
        seq_lens = batch.seq_lens.to(torch.int64)  # committed KV length; the bonus sits here
        drafts = pad_drafts(state.drafts.to(self.device, torch.int64), k)  # [bs, k]
        anchors = torch.cat((state.bonus_tokens.to(torch.int64)[:, None], drafts), dim=1)
        input_ids = mtp_layout_mod.build_input_ids(anchors, self.mask_token_ids[:k])
        positions = seq_lens[:, None] + offsets[None, :]  # [bs, W]
        slots = seq_lens[:, None] + torch.arange(width, device=self.device)[None, :]
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        out_cache_loc = req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], slots]
        custom_mask = mtp_layout_mod.tree_mask(lay, bs, int(self.mask_mode()), seq_lens=seq_lens)
        forward_batch = self._make_forward_batch(
            batch, input_ids, positions, out_cache_loc.to(torch.int64), custom_mask, width
        )
        with self._gates(k):
            out = self._target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True
            )
        logits_output = out.logits_output
        logits = logits_output.next_token_logits.view(bs, width, -1)
        anchor_logits = logits[:, : k + 1].clone()  # [bs, k+1, vocab]; penalties go in here
        result = verify_chain(batch, drafts, anchors[:, 0], anchor_logits)
        next_drafts = self._next_drafts(logits, group_slots, result.num_accepted, k)
        # Downstream (logprobs, hidden states) reads one row per emitted token: the anchors'.
        logits_output.next_token_logits = anchor_logits.view(bs * (k + 1), -1)
        if batch.return_logprob:
            compute_spec_logprobs(
                batch, logits_output, result.tokens.reshape(-1), chain_stride=k + 1
            )
        num_accepted = result.num_accepted.tolist()  # host sync: the step's work is done
        self._end_step(tic, k, num_accepted, state.num_real)
        accept_lens = (result.num_accepted + 1).to(torch.int32)
        new_seq_lens = batch.seq_lens + accept_lens.to(batch.seq_lens.dtype)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=result.tokens.to(torch.int32).reshape(-1),
            accept_lens=accept_lens,
            next_draft_input=MtpDraftInput(
                bonus_tokens=result.bonus,
                drafts=next_drafts,
                new_seq_lens=new_seq_lens,
                num_real=torch.full_like(result.bonus, k),
            ),
            speculative_num_draft_tokens=k + 1,
            speculative_output_stride=k + 1,
            num_non_draft_tokens_per_req=1,
            new_seq_lens=new_seq_lens,
            can_run_cuda_graph=out.can_run_cuda_graph,
        )

    def _forward_plain(self, batch, state: MtpDraftInput, tic: float) -> GenerationBatchResult:
        """k = 0 (speculation off): the plain decode step (``common/plain_step.py``); no gated
        rows, so the LoRA wrappers pass through."""
        step = plain_step(self, batch, state.bonus_tokens)
        self._end_step(tic, 0, [0] * len(batch.reqs), state.num_real)
        tokens = step.tokens
        return plain_result(
            batch,
            step,
            MtpDraftInput(
                bonus_tokens=tokens,
                drafts=tokens.new_zeros((tokens.shape[0], 0)),
                new_seq_lens=batch.seq_lens + 1,
                num_real=torch.zeros_like(tokens),
            ),
        )

    def _make_forward_batch(
        self,
        batch,
        input_ids: torch.Tensor,  # [bs, W]
        positions: torch.Tensor,  # [bs, W]
        out_cache_loc: torch.Tensor,  # [bs, W]
        custom_mask: torch.Tensor,
        width: int,
    ) -> ForwardBatch:
        """TARGET_VERIFY over the step layout: ``seq_lens`` stay the committed lengths."""
        positions = positions.reshape(-1)
        spec_info = MtpForwardInput(
            positions=positions, custom_mask=custom_mask, draft_token_num=width
        )
        return forward_batch_of(
            self, batch, ForwardMode.TARGET_VERIFY, input_ids, positions, out_cache_loc,
            spec_info, width,
        )  # fmt: skip

    @staticmethod
    def _next_drafts(
        logits: torch.Tensor,  # [bs, W, vocab]
        group_slots: torch.Tensor,  # [k+1, k] mask slots of each anchor's group
        num_accepted: torch.Tensor,  # [bs]
        k: int,
    ) -> torch.Tensor:
        """Greedy drafts from the masks after the last accepted anchor: [bs, k] (k >= 1)."""
        slots = group_slots[num_accepted]  # [bs, k]
        chosen = logits.gather(1, slots[:, :, None].expand(-1, -1, logits.shape[-1]))
        return torch.argmax(chosen, dim=-1)

    def _end_step(
        self,
        tic: float,  # when the step started
        k: int,
        num_accepted: list[int],  # per request
        num_real: torch.Tensor,  # [bs] drafts that came from masks (not padding)
    ) -> None:
        """Time the finished step (the caller has synced) and hand it to the stats, the
        controller and the trace."""
        elapsed = time.perf_counter() - tic
        self._observe(k, num_accepted, num_real, elapsed)
        if self._trace is not None:
            self._trace.write(
                f"{tic:.6f} {k} {len(num_accepted)} {elapsed * 1000:.2f}"
                f" {self.stats.last_decision}\n"
            )

    def _observe(
        self,
        k: int,
        num_accepted: list[int],  # per request
        num_real: torch.Tensor,  # [bs] drafts that came from masks (not padding)
        seconds: float,
    ) -> None:
        bs = len(num_accepted)
        self.stats.record(k, bs, sum(num_accepted), seconds)
        # Drafting shares the verify forward: the whole step is verify time.
        offered = num_real.clamp(max=k).tolist() if k > 0 else [0] * bs
        self.metrics.observe_step(num_accepted, offered, 0.0, seconds)
        self.metrics.observe_k(k)
        if self.controller is not None:
            decision = self.stats.last_decision
            if decision is not None:
                realised = 1 + sum(num_accepted) / max(bs, 1)
                self.metrics.observe_prediction(decision.lam, realised)
            if k > 0:
                # Only requests whose k drafts all came from masks say anything about α.
                real = (num_real >= k).tolist()
                counts = [a for a, ok in zip(num_accepted, real, strict=True) if ok]
                if counts:
                    self.controller.observe(k, counts)
        if self.stats.steps % LOG_EVERY_STEPS == 0:
            logger.info(self.stats.summary())
