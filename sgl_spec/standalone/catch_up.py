"""The committed tokens STANDALONE_FULL's draft model has not read yet, and the one forward that
reads them.

A step run without drafts (``--standalone-steps auto``/``cycle``/``off`` at 0 steps) verifies
the root alone; the draft extend after it would only keep the draft's KV in step, so it is
deferred: each request remembers the tokens it committed meanwhile (device tensors, in order),
and the next step that drafts first runs one EXTEND forward of the draft over them and the
bonus token, at their own positions. A fresh request (after prefill) has only its bonus token
to read. ``CATCH_UP_LIMIT`` bounds the forward: a request that defers that many tokens is
caught up at the end of that step.

The state lives on the scheduler's ``Req`` (an attribute of ours): ``None`` when the draft's
KV covers every committed token and the bonus, else the list of committed tokens without draft
KV, which precede the bonus token.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)

_PENDING = "_sgl_spec_draft_pending"
CATCH_UP_LIMIT = 32  # deferred tokens per request before the draft catches up anyway


def pending(req: object) -> list[torch.Tensor] | None:
    """The committed tokens of ``req`` the draft has not read (None: up to date)."""
    return getattr(req, _PENDING, None)


def mark_fresh(req: object) -> None:
    """``req`` came out of prefill: the draft read its prompt, not its bonus token."""
    setattr(req, _PENDING, [])


def mark_caught_up(req: object) -> None:
    setattr(req, _PENDING, None)


def defer(reqs: list, roots: torch.Tensor) -> None:
    """A step without drafts verified each request's root (``roots`` [bs], its bonus token
    before the step): an up-to-date request now lacks only its new bonus; one already behind
    lacks its old bonus too, now committed."""
    for i, req in enumerate(reqs):
        behind = pending(req)
        if behind is None:
            mark_fresh(req)
        else:
            behind.append(roots[i])


def any_behind(reqs: list) -> bool:
    """Some request lacks more than its bonus token (a plain decode of the bonus won't do)."""
    return any(pending(req) for req in reqs)


def any_pending(reqs: list) -> bool:
    return any(pending(req) is not None for req in reqs)


def over_limit(reqs: list) -> bool:
    return any(len(pending(req) or ()) >= CATCH_UP_LIMIT for req in reqs)


def _tokens(reqs: list, bonus: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """Each request's deferred tokens then its bonus token, flat; and how many per request."""
    tokens, counts = [], []
    for i, req in enumerate(reqs):
        behind = pending(req) or []
        tokens.extend(behind)
        tokens.append(bonus[i])
        counts.append(len(behind) + 1)
    return tokens, counts


def catch_up_forward(
    runner: Any,  # the draft's ModelRunner
    reqs: list,
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: list[int],  # per request: the bonus token's position
    bonus: torch.Tensor,  # [bs] the bonus tokens
    sampling_info: Any,
) -> torch.Tensor:
    """One EXTEND forward of the draft over each request's deferred tokens and its bonus
    token (an up-to-date request reads its bonus again: its KV slot is rewritten with the same
    values), at positions ``seq_len - len(deferred) .. seq_len``; returns the bonus rows'
    logits [bs, vocab]. Marks every request caught up."""
    device = bonus.device
    tokens, counts = _tokens(reqs, bonus)
    ends = [n + 1 for n in seq_lens]  # KV length after the forward (the bonus included)
    starts = [e - c for e, c in zip(ends, counts, strict=True)]
    positions = torch.cat(
        [torch.arange(s, e, dtype=torch.int64) for s, e in zip(starts, ends, strict=True)]
    )
    rows = torch.repeat_interleave(
        req_pool_indices.to(torch.int64).cpu(), torch.tensor(counts, dtype=torch.int64)
    )
    req_to_token = runner.req_to_token_pool.req_to_token
    out_cache_loc = req_to_token[rows.to(req_to_token.device), positions.to(req_to_token.device)]
    total = sum(counts)
    offsets = [0]
    for c in counts[:-1]:
        offsets.append(offsets[-1] + c)
    ints = {"dtype": torch.int32, "device": device}
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(reqs),
        input_ids=torch.stack(tokens).to(device, torch.int64),
        req_pool_indices=req_pool_indices,
        seq_lens=torch.tensor(ends, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor(ends, dtype=torch.int64),
        seq_lens_sum=sum(ends),
        out_cache_loc=out_cache_loc.to(device, torch.int64),
        positions=positions.to(device),
        extend_num_tokens=total,
        extend_seq_lens=torch.tensor(counts, **ints),
        extend_prefix_lens=torch.tensor(starts, **ints),
        extend_start_loc=torch.tensor(offsets, **ints),
        extend_seq_lens_cpu=counts,
        extend_prefix_lens_cpu=starts,
        extend_logprob_start_lens_cpu=counts,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        spec_algorithm=runner.spec_algorithm,
        return_hidden_states_before_norm=False,
        sampling_info=sampling_info,
    )
    runner.kv_index_translator.bind_own_plan(forward_batch)
    logits = runner.forward(forward_batch).logits_output.next_token_logits
    for req in reqs:
        mark_caught_up(req)
    return logits
