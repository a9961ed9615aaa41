"""What SPECBLOCK carries between decode steps and hands to SGLang's verify.

``SpecBlockDraftInput`` is the per-request state between two steps: the bonus token (verified,
no KV yet, at position ``seq_len``) and the drafter state ``h^(L)`` the next tree's first block
conditions on (slot 1 of the drafter block of the last processed position, ``drafting``), and
the committed tokens the drafter has not read yet (``pending``).
The verify side is ``sgl_spec.common.tree_verify.IrregularTreeVerifyInput``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_spec.common.draft_input import CarriedDraftInput
from sgl_spec.specblock.pending import padded


@dataclass
class SpecBlockDraftInput(CarriedDraftInput):
    root_cond: torch.Tensor  # [bs, d] drafter state the next tree's first block reads
    # Committed tokens the drafter has not read yet (``pending.py``): features [bs, P, F],
    # token ids [bs, P], how many per request [bs]. ``root_cond`` is stale while any are.
    pending_features: torch.Tensor
    pending_tokens: torch.Tensor
    pending_count: torch.Tensor

    def merged(self, name: str, mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
        """Pending rows of different widths are padded to the wider (padding is never read)."""
        if name in ("pending_features", "pending_tokens"):
            width = max(mine.shape[1], theirs.shape[1])
            mine, theirs = padded(mine, width), padded(theirs, width)
        return torch.cat((mine, theirs))
