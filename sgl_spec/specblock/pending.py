"""Committed tokens SPECBLOCK's drafter has not read yet: those of steps run without drafts.

A step that verifies the root alone (node budget 1, ``--specblock-budget auto``/``off``/
``cycle``) needs nothing from the drafter, so the drafter's extend over the committed token is
deferred: the token and the target features the verify forward captured for it wait here, in
the per-request state SGLang carries between steps (``info.SpecBlockDraftInput``), and the
next step that drafts first extends the drafter over all of them in one forward. Each request
holds ``count`` of them, left-aligned in rows padded to the batch's largest count; they are
the positions ``committed - count .. committed - 1``. ``PENDING_LIMIT`` bounds the memory: a
request that reaches it is caught up at the end of that step.
"""

from __future__ import annotations

import torch

PENDING_LIMIT = 16  # deferred tokens per request before the drafter catches up anyway


def no_pending(bs: int, feature_size: int, dtype: torch.dtype, device: object) -> dict:
    """The pending fields of ``SpecBlockDraftInput`` for ``bs`` requests with none."""
    return {
        "pending_features": torch.zeros(bs, 0, feature_size, dtype=dtype, device=device),
        "pending_tokens": torch.zeros(bs, 0, dtype=torch.int64, device=device),
        "pending_count": torch.zeros(bs, dtype=torch.int64, device=device),
    }


def padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    """``rows`` ([bs, P, ...]) with zero columns appended up to ``width`` >= P."""
    extra = width - rows.shape[1]
    if extra <= 0:
        return rows
    pad = rows.new_zeros((rows.shape[0], extra, *rows.shape[2:]))
    return torch.cat((rows, pad), dim=1)


def appended(
    features: torch.Tensor,  # [bs, P, F]
    tokens: torch.Tensor,  # [bs, P]
    count: torch.Tensor,  # [bs]
    new_features: torch.Tensor,  # [bs, F] the token committed this step
    new_tokens: torch.Tensor,  # [bs]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each request's pending rows with this step's committed token after its own last one."""
    width = int(count.max()) + 1 if count.numel() else 1
    features = padded(features, width).clone()
    tokens = padded(tokens, width).clone()
    rows = torch.arange(count.shape[0], device=count.device)
    features[rows, count] = new_features.to(features.dtype)
    tokens[rows, count] = new_tokens.to(tokens.dtype)
    return features, tokens, count + 1
