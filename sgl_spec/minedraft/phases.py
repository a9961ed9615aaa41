"""The rows of one MINEDRAFT decode call: whether the batch may be split into two phases, the
sub-batch a phase verifies, and the phases' results merged back into one result in the batch's
row order (as one verify of the whole batch returns it). The step itself is ``worker.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from sglang.srt.managers.utils import GenerationBatchResult

from sgl_spec.minedraft.info import MineDraftDraftInput


@dataclass
class Phase:
    rows: list[int]  # batch rows verified
    result: GenerationBatchResult


def can_split(batch) -> bool:
    """Rows whose outputs SGLang post-processes per batch position need one verify."""
    info = batch.sampling_info
    penalizer = getattr(info, "penalizer_orchestrator", None)
    return not (
        batch.return_logprob
        or batch.return_hidden_states
        or batch.has_grammar
        or (penalizer is not None and penalizer.is_required)
        or info.has_custom_logit_processor
        or any(getattr(info, "return_sampling_masks", None) or ())
    )


def sub_batch(batch, rows: list[int]):
    """A copy of ``batch`` holding ``rows`` only; ``batch`` itself is left untouched (its
    sampling info is copied before SGLang's in-place filter; ``can_split`` keeps rows with
    penalizer state, which that filter would mutate, out of split steps)."""
    sub = copy.copy(batch)
    sub.spec_info = None
    if len(rows) != len(batch.reqs):
        sub.sampling_info = copy.copy(batch.sampling_info)
        sub.sampling_info.penalizer_orchestrator = _NoPenalties()
        sub.filter_batch(keep_indices=rows)
    return sub


class _NoPenalties:
    """Stands in for the penalizer orchestrator in a split step (none is required there,
    ``can_split``): SGLang's filter would otherwise mutate the shared one, or fail on None."""

    is_required = False

    def filter(self, keep_indices) -> None:
        return None


def merge_phases(batch, phases: list[Phase], width: int, device) -> GenerationBatchResult:
    """One result in the batch's row order, as one verify of the whole batch returns it."""
    if len(phases) == 1 and phases[0].rows == list(range(len(batch.reqs))):
        result = phases[0].result
        result.next_draft_input = MineDraftDraftInput.carried(
            result.next_draft_input.bonus_tokens, result.new_seq_lens
        )
        return result
    bs = len(batch.reqs)
    first = phases[0].result
    ids = torch.zeros(bs, width, dtype=first.next_token_ids.dtype, device=device)
    accept = torch.zeros(bs, dtype=first.accept_lens.dtype, device=device)
    seq_lens = batch.seq_lens.clone()
    bonus = torch.zeros(bs, dtype=torch.int64, device=device)
    for phase in phases:
        rows = torch.tensor(phase.rows, dtype=torch.long, device=device)
        res = phase.result
        ids[rows] = res.next_token_ids.view(len(phase.rows), width)
        accept[rows] = res.accept_lens
        seq_lens[rows] = res.new_seq_lens.to(seq_lens.dtype)
        bonus[rows] = res.next_draft_input.bonus_tokens.to(torch.int64)
    return GenerationBatchResult(
        logits_output=phases[-1].result.logits_output,
        next_token_ids=ids.reshape(-1),
        can_run_cuda_graph=False,
        speculative_num_draft_tokens=width,
        next_draft_input=MineDraftDraftInput(bonus_tokens=bonus, new_seq_lens=seq_lens),
        accept_lens=accept,
        new_seq_lens=seq_lens,
    )
