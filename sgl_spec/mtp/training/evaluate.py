"""Held-out draft quality of an MTP adapter: how often the masks match the target's greedy tokens.

Along the target's own greedy continuation ``x`` of a held-out prompt, every position ``p`` of
the generated part is an anchor; mask ``j`` of anchor ``p`` is correct when its argmax equals
``x[p+j+1]``, the token the target itself writes there. Averaged over all anchors:

- ``mask_correct[j]``: P(mask j correct), each slot on its own;
- ``prefix_correct[j]``: P(masks 1..j all correct), what a chain of ``j`` drafts needs;
- ``conditional[j]``: P(mask j correct | masks 1..j-1 correct), comparable to a draft model's α_j;
- ``expected_acceptance_length[k]``: ``1 + Σ_{j≤k} prefix_correct[j]``, tokens per step
  (bonus token included) when the drafts of a step are the masks of the last accepted anchor
  (paper §4.3); for ``k = 1..k_max``.

The chain rates are ``sgl_spec.training.acceptance``'s (the masks of an anchor are its chain).
Everything runs in fp32 on the stored adapter weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_spec.mtp.gated_lora import MtpHandle
from sgl_spec.mtp.layout import training_layout
from sgl_spec.mtp.training.trainer import mask_logits
from sgl_spec.training.acceptance import prefix_rates, round_rates


def agreement_rates(correct: torch.Tensor) -> dict:  # correct: [num_anchors, k] bool
    """The rates of the module docstring from a per-anchor, per-slot correctness matrix."""
    c = correct.reshape(-1, correct.shape[-1])
    return {
        "mask_correct": round_rates(c.float().mean(0)),
        **prefix_rates(c),
        "num_anchors": int(c.shape[0]),
    }


@torch.no_grad()
def mask_agreement(
    model: torch.nn.Module,
    handle: MtpHandle,
    seqs: torch.Tensor,  # [n, T] prompts followed by the target's greedy continuation
    first_anchor: int,
    mask_token_ids: Sequence[int],
    batch_size: int = 8,
) -> dict:
    """Rates over every anchor ``p`` in ``[first_anchor, T-k-2]`` (all ``k`` labels exist)."""
    k = handle.adapter.config.k_max
    t = seqs.shape[1]
    anchors = torch.arange(first_anchor, t - k - 1)  # [A]
    if anchors.numel() == 0:
        raise ValueError(f"sequences of {t} tokens leave no anchor with {k} labels")
    correct = []
    for chunk in seqs.split(batch_size):
        layout = training_layout(chunk, anchors, k, mask_token_ids)
        logits = mask_logits(model, handle, layout, bf16_autocast=False)  # [b, A*k, vocab]
        labels = layout.labels[:, t:]
        correct.append((logits.argmax(-1) == labels).view(chunk.shape[0], -1, k))
    rates = agreement_rates(torch.cat(correct))
    rates.update(num_sequences=int(seqs.shape[0]), seq_len=t, first_anchor=first_anchor, k_max=k)
    return rates
