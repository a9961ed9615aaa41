"""The per-request state our algorithms carry in SGLang's batch between two decode steps.

Every algorithm carries the bonus token (verified, no KV yet, at position ``seq_len``) and the
committed KV length; subclasses add their own per-request tensors. SGLang filters and merges
the batch's ``spec_info`` as requests finish and join, so every per-request tensor field
(first dimension = batch) is filtered and concatenated here, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


@dataclass
class CarriedDraftInput(SpecInput):
    bonus_tokens: torch.Tensor  # [bs] last verified token, not yet in the KV cache
    new_seq_lens: torch.Tensor  # [bs] committed KV length

    # Read by SGLang's generic relay/scheduler code on any draft input.
    topk_p: ClassVar[torch.Tensor | None] = None
    topk_index: ClassVar[torch.Tensor | None] = None
    hidden_states: ClassVar[torch.Tensor | None] = None
    # keyword-only so that subclasses can add per-request fields without defaults
    future_indices: torch.Tensor | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        # UNO_STATE: "carried state, not a forward input"; no code outside UNO's own files
        # branches on it, and plugins cannot add enum members (checked at start-up:
        # patches/spec_internals.py).
        super().__init__(SpecInputType.UNO_STATE)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    @classmethod
    def carried(cls, bonus_tokens: torch.Tensor, seq_lens: torch.Tensor) -> CarriedDraftInput:
        """The state after a prefill or a verify: each request's bonus token (SGLang's sampled
        ids, any shape and integer dtype) and its committed KV length."""
        return cls(bonus_tokens=bonus_tokens.reshape(-1).to(torch.int64), new_seq_lens=seq_lens)

    def per_request_fields(self) -> list[str]:
        """The tensor fields with one row per request (all but ``future_indices``)."""
        return [
            f.name
            for f in fields(self)
            if f.name != "future_indices" and isinstance(getattr(self, f.name), torch.Tensor)
        ]

    def filter_batch(
        self, new_indices: torch.Tensor, new_indices_cpu: list[int] | None = None
    ) -> None:
        for name in self.per_request_fields():
            setattr(self, name, getattr(self, name)[new_indices])

    def merge_batch(self, other: CarriedDraftInput) -> None:
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(self).__name__} with {type(other).__name__}")
        for name in self.per_request_fields():
            setattr(self, name, self.merged(name, getattr(self, name), getattr(other, name)))

    def merged(self, name: str, mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
        """Field ``name`` of the merged batch: this batch's rows, then the other's."""
        del name
        return torch.cat((mine, theirs))
