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

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from sgl_spec.common.draft_input import CarriedDraftInput


def pad_drafts(drafts: torch.Tensor, width: int) -> torch.Tensor:
    """[bs, n] -> [bs, width]: truncate, or pad with token 0. A padded draft is only a bad
    guess; verification is exact whatever the drafts are, so this never changes outputs."""
    if drafts.shape[1] >= width:
        return drafts[:, :width]
    pad = drafts.new_zeros((drafts.shape[0], width - drafts.shape[1]))
    return torch.cat((drafts, pad), dim=1)


@dataclass
class MtpDraftInput(CarriedDraftInput):
    drafts: torch.Tensor  # [bs, num_drafts] proposals for the tokens after the bonus
    num_real: torch.Tensor  # [bs] how many of the drafts came from masks (the rest: padding)

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

    def merged(self, name: str, mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
        """Drafts of different widths are padded to the wider (padding is never accepted)."""
        if name == "drafts":
            width = max(mine.shape[1], theirs.shape[1])
            mine, theirs = pad_drafts(mine, width), pad_drafts(theirs, width)
        return torch.cat((mine, theirs))


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
