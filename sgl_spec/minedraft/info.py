"""What MINEDRAFT carries between decode steps in SGLang's batch.

Only the bonus token (verified, no KV yet, at position ``seq_len``) and the committed length:
the drafts themselves live in the worker, keyed by request id, because they are produced by the
draft server one step ahead for half of the batch (paper §5.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


@dataclass
class MineDraftDraftInput(SpecInput):
    bonus_tokens: torch.Tensor  # [bs] last verified token, not yet in the KV cache
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
        self.new_seq_lens = self.new_seq_lens[new_indices]

    def merge_batch(self, other: MineDraftDraftInput) -> None:
        if not isinstance(other, MineDraftDraftInput):
            raise TypeError(f"cannot merge MineDraftDraftInput with {type(other).__name__}")
        self.bonus_tokens = torch.cat((self.bonus_tokens, other.bonus_tokens))
        self.new_seq_lens = torch.cat((self.new_seq_lens, other.new_seq_lens))
