"""What SPECBLOCK carries between decode steps and hands to SGLang's verify.

``SpecBlockDraftInput`` is the per-request state between two steps: the bonus token (verified,
no KV yet, at position ``seq_len``) and the drafter state ``h^(L)`` the next tree's first block
conditions on (slot 1 of the drafter block of the last processed position, ``drafting``).
The verify side is ``sgl_spec.verify.info.IrregularTreeVerifyInput``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


@dataclass
class SpecBlockDraftInput(SpecInput):
    bonus_tokens: torch.Tensor  # [bs] last verified token, not yet in the KV cache
    root_cond: torch.Tensor  # [bs, d] drafter state the next tree's first block reads
    new_seq_lens: torch.Tensor  # [bs] committed KV length

    # Read by SGLang's generic relay/scheduler code on any draft input.
    topk_p: ClassVar[torch.Tensor | None] = None
    topk_index: ClassVar[torch.Tensor | None] = None
    hidden_states: ClassVar[torch.Tensor | None] = None
    future_indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # UNO_STATE: "carried state, not a forward input" (see sgl_spec/mtp/info.py).
        super().__init__(SpecInputType.UNO_STATE)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    def filter_batch(
        self, new_indices: torch.Tensor, new_indices_cpu: list[int] | None = None
    ) -> None:
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.root_cond = self.root_cond[new_indices]
        self.new_seq_lens = self.new_seq_lens[new_indices]

    def merge_batch(self, other: SpecBlockDraftInput) -> None:
        if not isinstance(other, SpecBlockDraftInput):
            raise TypeError(f"cannot merge SpecBlockDraftInput with {type(other).__name__}")
        self.bonus_tokens = torch.cat((self.bonus_tokens, other.bonus_tokens))
        self.root_cond = torch.cat((self.root_cond, other.root_cond))
        self.new_seq_lens = torch.cat((self.new_seq_lens, other.new_seq_lens))
