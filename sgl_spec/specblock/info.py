"""What SPECBLOCK carries between decode steps and hands to SGLang's verify.

``SpecBlockDraftInput`` is the per-request state between two steps: the bonus token (verified,
no KV yet, at position ``seq_len``) and the drafter state ``h^(L)`` the next tree's first block
conditions on (slot 1 of the drafter block of the last processed position, ``drafting``), and
how many committed tokens the drafter has not read yet (``target_rows``).
The verify side is ``sgl_spec.common.tree_verify.IrregularTreeVerifyInput``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_spec.common.draft_input import CarriedDraftInput


@dataclass
class SpecBlockDraftInput(CarriedDraftInput):
    root_cond: torch.Tensor  # [bs, d] drafter state the next tree's first block reads
    # Committed tokens the drafter has not read yet, per request: the last ``pending_count``
    # positions (their rows: ``target_rows.py``). ``root_cond`` is stale while any are.
    pending_count: torch.Tensor
