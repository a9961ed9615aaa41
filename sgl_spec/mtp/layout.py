"""Input layout of one MTP step and the equivalent training layout (paper §4.3).

A step for one request with ``k`` drafts feeds ``k + 1`` anchors (the bonus token of the last
step and the ``k`` drafts), each followed by ``k`` mask tokens: width ``W = (k + 1)²``. With
``seq_len`` committed tokens in the KV cache, anchor ``i`` sits at position ``seq_len + i`` and
mask ``j`` (1..k) of group ``i`` at ``seq_len + i + j``.

Slot order (a fixed contract shared by training and the SGLang worker)::

    slots 0..k                     anchors 0..k
    slot  k + 1 + i*k + (j - 1)    mask j of group i

Visibility: anchor ``i`` sees the prefix and anchors ``0..i`` (plain causal verification, gate 0,
bit-exact base model); mask ``(i, j)`` sees the prefix, anchors ``0..i`` and masks ``(i, 1..j)``.
So the output at anchor ``i`` is the base model's next-token prediction after anchor ``i``, and
the output at mask ``(i, j)`` predicts the token at position ``seq_len + i + j + 1``, the
``(j+1)``-th token after anchor ``i``. If anchors ``0..a`` are accepted, the masks of group ``a``
are the drafts of the next step, whose anchors are then ``[bonus, those k drafts]``.

Training sees the same thing: the whole sequence as ordinary causal tokens (gate 0; they play the
anchors), then for each chosen anchor position ``p``, ``k`` masks at positions ``p+1..p+k`` that
see ``x[0..p]`` and their own group's earlier masks. The tests check that both layouts give the
same mask logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

IGNORE_INDEX = -100


class MaskFormat(IntEnum):
    """SGLang's custom-mask formats (same values as ``sglang ... spec_tree.TreeMaskMode``).

    ``FULL_MASK``: per request a ``[W, seq_len + W]`` bool matrix (prefix columns all True),
    flattened and concatenated over requests (the GPU verify kernels). ``QLEN_ONLY``: per request
    the ``[W, W]`` block only (the CPU verify kernel).
    """

    FULL_MASK = 0
    QLEN_ONLY = 1


@dataclass(frozen=True, eq=False)
class MtpLayout:
    """Per-slot tables of one request's step input for ``k`` drafts (``W = (k+1)²`` slots)."""

    k: int
    position_offsets: torch.Tensor  # [W] long: anchor i -> i, mask (i, j) -> i + j
    is_mask: torch.Tensor  # [W] bool
    mask_index: torch.Tensor  # [W] long: j - 1 for masks, -1 for anchors
    group: torch.Tensor  # [W] long: i for anchor i and its masks
    visibility: torch.Tensor  # [W, W] bool: [query slot, key slot]

    @property
    def width(self) -> int:
        return (self.k + 1) ** 2

    def anchor_slot(self, i: int) -> int:
        self._check(i, 1)
        return i

    def mask_slot(self, i: int, j: int) -> int:
        """Slot of mask ``j`` (1..k) of group ``i`` (0..k)."""
        self._check(i, j)
        return self.k + 1 + i * self.k + (j - 1)

    def mask_slots(self, i: int) -> torch.Tensor:  # [k] long
        """Slots of group ``i``'s masks, ``j = 1..k`` in order (its next-step drafts)."""
        self._check(i, 1 if self.k else 0)
        start = self.k + 1 + i * self.k
        return torch.arange(start, start + self.k, device=self.is_mask.device)

    def to(self, device: torch.device | str) -> MtpLayout:
        return MtpLayout(
            self.k,
            *(
                t.to(device)
                for t in (
                    self.position_offsets,
                    self.is_mask,
                    self.mask_index,
                    self.group,
                    self.visibility,
                )
            ),
        )

    def _check(self, i: int, j: int) -> None:
        if not 0 <= i <= self.k:
            raise IndexError(f"group/anchor index {i} outside 0..{self.k}")
        if self.k and not 1 <= j <= self.k:
            raise IndexError(f"mask index j={j} outside 1..{self.k}")


def mtp_layout(k: int) -> MtpLayout:
    """The layout for ``k >= 0`` drafts (``k == 0``: one anchor, plain decoding)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k (number of drafts) must be an int >= 0, got {k!r}")
    anchors = torch.arange(k + 1)
    g = torch.arange(k + 1).repeat_interleave(k)  # [(k+1)*k] group of each mask
    j = torch.arange(1, k + 1).repeat(k + 1)  # [(k+1)*k] j of each mask
    group = torch.cat([anchors, g])
    is_mask = torch.cat(
        [torch.zeros(k + 1, dtype=torch.bool), torch.ones(g.numel(), dtype=torch.bool)]
    )
    mask_index = torch.cat([torch.full((k + 1,), -1), j - 1])
    offsets = torch.cat([anchors, g + j])
    # [query, key] tables: query attributes along dim 0, key attributes along dim 1
    q_group, k_group = group[:, None], group[None, :]
    q_mask, k_mask = is_mask[:, None], is_mask[None, :]
    sees_anchor = ~k_mask & (k_group <= q_group)
    sees_own_mask = (
        q_mask & k_mask & (k_group == q_group) & (mask_index[None, :] <= mask_index[:, None])
    )
    return MtpLayout(k, offsets, is_mask, mask_index, group, sees_anchor | sees_own_mask)


def build_input_ids(
    anchors: torch.Tensor,  # [bs, k+1]
    mask_token_ids: Sequence[int] | torch.Tensor,  # [>= k]; slot j uses mask_token_ids[j-1]
) -> torch.Tensor:  # [bs, W]
    """Anchors in slots ``0..k``, then each group's mask tokens ``1..k``."""
    bs, k = anchors.shape[0], anchors.shape[1] - 1
    ids = torch.as_tensor(mask_token_ids, dtype=anchors.dtype, device=anchors.device).reshape(-1)
    if ids.numel() < k:
        raise ValueError(f"need {k} mask_token_ids for k={k} drafts, got {ids.numel()}")
    masks = ids[:k].repeat(k + 1).expand(bs, -1)  # [bs, (k+1)*k]
    return torch.cat([anchors, masks], dim=1)


def _mask_format(mode: MaskFormat | int | str) -> MaskFormat:
    try:
        return MaskFormat[mode] if isinstance(mode, str) else MaskFormat(int(mode))
    except (KeyError, ValueError):
        raise ValueError(
            f"tree mask mode {mode!r} is not supported; use FULL_MASK or QLEN_ONLY"
        ) from None


def tree_mask(
    layout: MtpLayout,
    bs: int,
    mode: MaskFormat | int | str,
    seq_lens: torch.Tensor | None = None,  # [bs], required for FULL_MASK
    seq_lens_sum: int | None = None,  # sum(seq_lens), to skip a device sync
) -> torch.Tensor:  # flat bool
    """The custom attention mask of a batch in SGLang's flattened format (see :class:`MaskFormat`)."""
    fmt, w, vis = _mask_format(mode), layout.width, layout.visibility
    if fmt == MaskFormat.QLEN_ONLY:
        return vis.expand(bs, w, w).reshape(-1)
    if seq_lens is None or seq_lens.numel() != bs:
        raise ValueError(f"FULL_MASK needs seq_lens with {bs} entries")
    s = seq_lens.to(vis.device).long()
    total = int(s.sum()) if seq_lens_sum is None else int(seq_lens_sum)
    row_len = s + w  # [bs]
    starts = w * (torch.cumsum(row_len, 0) - row_len)  # [bs] first element of each request
    r = torch.arange(w, device=vis.device)
    idx = (
        starts[:, None, None] + r[None, :, None] * row_len[:, None, None] + s[:, None, None]
    ) + r[None, None, :]  # [bs, W, W] flat index of (request, query slot, key slot)
    out = torch.ones(w * (total + bs * w), dtype=torch.bool, device=vis.device)
    out[idx.reshape(-1)] = vis.expand(bs, w, w).reshape(-1)
    return out


@dataclass(frozen=True, eq=False)
class TrainingLayout:
    """A training batch: ``num_tokens`` sequence tokens, then ``k`` masks per anchor.

    Masks of anchor ``a`` (in the order given) sit at ``num_tokens + a*k + (j-1)``.
    """

    num_tokens: int
    k: int
    input_ids: torch.Tensor  # [bs, L]
    position_ids: torch.Tensor  # [bs, L]
    visibility: torch.Tensor  # [bs, L, L] bool: [query, key]
    gate: torch.Tensor  # [bs, L] float: 0 for sequence tokens, 1 for masks
    mask_index: torch.Tensor  # [bs, L] long: j - 1 for masks, -1 for sequence tokens
    labels: torch.Tensor  # [bs, L] long: x[p+j+1] at mask (p, j), else IGNORE_INDEX

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [bs, 1, L, L]
        """Additive 4D mask (0 = visible); accepted as-is by HF eager and sdpa attention."""
        return additive_mask(self.visibility, dtype)[:, None]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """0 where ``visible``, the dtype's most negative value elsewhere."""
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill(~visible, torch.finfo(dtype).min)


def training_layout(
    tokens: torch.Tensor,  # [bs, T]
    anchors: torch.Tensor,  # [bs, A] or [A] anchor positions p in [0, T)
    k: int,
    mask_token_ids: Sequence[int] | torch.Tensor,  # [>= k]
) -> TrainingLayout:
    """Sequence + masks for HF training; the label of mask ``j`` of anchor ``p`` is ``x[p+j+1]``."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1 for training, got {k!r}")
    bs, t = tokens.shape
    dev = tokens.device
    p = anchors.to(dev).long()
    p = p.expand(bs, -1) if p.dim() == 1 else p  # [bs, A]
    if p.shape[0] != bs or (p.numel() and (int(p.min()) < 0 or int(p.max()) >= t)):
        raise ValueError(f"anchors must be positions in [0, {t}) for each of the {bs} rows")
    a = p.shape[1]
    ids = torch.as_tensor(mask_token_ids, dtype=tokens.dtype, device=dev).reshape(-1)
    if ids.numel() < k:
        raise ValueError(f"need {k} mask_token_ids, got {ids.numel()}")
    j = torch.arange(1, k + 1, device=dev).repeat(a)  # [A*k]
    pa = p.repeat_interleave(k, dim=1)  # [bs, A*k] anchor of each mask
    target = pa + j  # [bs, A*k] position of the mask; it predicts target + 1
    label_pos = target + 1
    labels = torch.where(
        label_pos < t,
        tokens.gather(1, label_pos.clamp(max=t - 1)),
        torch.full_like(label_pos, IGNORE_INDEX),
    )
    m = a * k
    length = t + m
    vis = torch.zeros(bs, length, length, dtype=torch.bool, device=dev)
    vis[:, :t, :t] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    vis[:, t:, :t] = torch.arange(t, device=dev)[None, None, :] <= pa[:, :, None]
    grp = torch.arange(a, device=dev).repeat_interleave(k)
    vis[:, t:, t:] = (grp[:, None] == grp[None, :]) & (j[None, :] <= j[:, None])
    return TrainingLayout(
        num_tokens=t,
        k=k,
        input_ids=torch.cat([tokens, ids[:k].repeat(a).expand(bs, -1)], dim=1),
        position_ids=torch.cat([torch.arange(t, device=dev).expand(bs, -1), target], dim=1),
        visibility=vis,
        gate=torch.cat([torch.zeros(bs, t, device=dev), torch.ones(bs, m, device=dev)], dim=1),
        mask_index=torch.cat([torch.full((bs, t), -1, device=dev), (j - 1).expand(bs, -1)], dim=1),
        labels=torch.cat([torch.full((bs, t), IGNORE_INDEX, device=dev), labels], dim=1),
    )
