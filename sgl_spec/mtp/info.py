"""What MTP_LORA carries between steps and hands to SGLang's attention for one step.

``MtpDraftInput`` is the per-request state between two decode steps: the bonus token (verified,
no KV yet, sits at position ``seq_len``) and the drafts the masks after the last accepted anchor
produced (paper §4.3: "the masks following the last accepted anchor simultaneously provide the
next-step drafts"). ``MtpForwardInput`` is the spec_info of the one target forward per step: a
fixed width of (k+1)² tokens per request with a custom attention mask, in SGLang's
TARGET_VERIFY mode (the same path EAGLE's tree verify uses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


def pad_drafts(drafts: torch.Tensor, width: int) -> torch.Tensor:
    """[bs, n] -> [bs, width]: truncate, or pad with token 0. A padded draft is only a bad
    guess; verification is exact whatever the drafts are, so this never changes outputs."""
    if drafts.shape[1] >= width:
        return drafts[:, :width]
    pad = drafts.new_zeros((drafts.shape[0], width - drafts.shape[1]))
    return torch.cat((drafts, pad), dim=1)


@dataclass
class MtpDraftInput(SpecInput):
    bonus_tokens: torch.Tensor  # [bs] last verified token, not yet in the KV cache
    drafts: torch.Tensor  # [bs, num_drafts] proposals for the tokens after the bonus
    new_seq_lens: torch.Tensor  # [bs] committed KV length
    num_real: torch.Tensor  # [bs] how many of the drafts came from masks (the rest: padding)

    # Read by SGLang's generic relay/scheduler code on any draft input.
    topk_p: ClassVar[torch.Tensor | None] = None
    topk_index: ClassVar[torch.Tensor | None] = None
    hidden_states: ClassVar[torch.Tensor | None] = None
    future_indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # UNO_STATE: "carried state, not a forward input"; no code outside UNO's own files
        # branches on it, and plugins cannot add enum members.
        super().__init__(SpecInputType.UNO_STATE)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    @property
    def num_drafts(self) -> int:
        return int(self.drafts.shape[1])

    @classmethod
    def after_prefill(cls, bonus_tokens: torch.Tensor, seq_lens: torch.Tensor) -> MtpDraftInput:
        """No masks ran yet: zero drafts; the first decode step drafts without verifying."""
        bonus = bonus_tokens.reshape(-1).to(torch.int64)
        drafts = torch.zeros((bonus.shape[0], 0), dtype=torch.int64, device=bonus.device)
        num_real = torch.zeros(bonus.shape[0], dtype=torch.int64, device=bonus.device)
        return cls(bonus_tokens=bonus, drafts=drafts, new_seq_lens=seq_lens, num_real=num_real)

    def filter_batch(
        self, new_indices: torch.Tensor, new_indices_cpu: list[int] | None = None
    ) -> None:
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.drafts = self.drafts[new_indices]
        self.new_seq_lens = self.new_seq_lens[new_indices]
        self.num_real = self.num_real[new_indices]

    def merge_batch(self, other: MtpDraftInput) -> None:
        if not isinstance(other, MtpDraftInput):
            raise TypeError(f"cannot merge MtpDraftInput with {type(other).__name__}")
        width = max(self.num_drafts, other.num_drafts)
        self.bonus_tokens = torch.cat((self.bonus_tokens, other.bonus_tokens))
        self.drafts = torch.cat((pad_drafts(self.drafts, width), pad_drafts(other.drafts, width)))
        self.new_seq_lens = torch.cat((self.new_seq_lens, other.new_seq_lens))
        self.num_real = torch.cat((self.num_real, other.num_real))


@dataclass
class MtpForwardInput(SpecInput):
    """spec_info of one MTP_LORA step forward (TARGET_VERIFY mode, custom tree mask)."""

    positions: torch.Tensor  # [bs * W]
    draft_token_num: int  # W = (k+1)**2 tokens per request
    # flattened, QLEN_ONLY or FULL_MASK per the attention backend (declared after the
    # non-defaults: SpecInput's class attribute gives it a default for dataclasses)
    custom_mask: torch.Tensor | None = None

    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    hidden_states: torch.Tensor | None = None
    num_tokens_per_req: int = field(init=False)
    num_tokens_for_logprob_per_req: int = field(init=False)

    def __post_init__(self) -> None:
        super().__init__(SpecInputType.UNO_VERIFY)
        self.num_tokens_per_req = self.draft_token_num
        self.num_tokens_for_logprob_per_req = self.draft_token_num

    @property
    def tree_topk(self) -> int:
        """Not a chain: SGLang's CPU backend applies ``custom_mask`` only when this != 1."""
        return -1
