"""What SPECBLOCK's drafter needs of each committed token it has not read yet, per target KV
location: the token, the target's (low, mid, top) features of it, and whether the drafter has
read it (its drafter KV row, ``draft_kv``, holds that token).

With node budgets that run steps without drafts (``--specblock-budget auto``/``off``/``cycle``)
the drafter reads committed tokens only before a step that drafts for them: a plain step and a
prefill store their tokens' rows here, and the next drafting step first extends the drafter
over each request's unread positions in one forward (``follow.DrafterFollowing._catch_up``).
While the controller keeps drafting off, the drafter does no work at all; a request that ends
before anything drafts for it is never read. Rows are keyed by location, as SGLang's KV pool
is, so a radix-cache hit finds the rows of its prefix and whether they were read, and storing
is one scatter per step (no per-request buffers copied between steps).
"""

from __future__ import annotations

import torch


def target_rows_bytes_per_row(feature_size: int, dtype: torch.dtype) -> int:
    """Bytes per target KV location: features, the token id (int64), the read flag."""
    return feature_size * torch.empty((), dtype=dtype).element_size() + 8 + 1


def locations(
    req_to_token: torch.Tensor,
    reqs: torch.Tensor,  # [bs]
    starts: torch.Tensor,  # [bs] first position
    counts: torch.Tensor,  # [bs] positions from it (>= 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target KV locations [bs, P] of positions ``starts .. starts+counts-1`` of each request,
    left-aligned and padded to the largest count P, and which of them are real [bs, P]."""
    p = max(int(counts.max()), 1) if counts.numel() else 1
    cols = torch.arange(p, device=counts.device)
    valid = cols[None, :] < counts[:, None]
    positions = (starts[:, None] + cols[None, :]).clamp(max=req_to_token.shape[1] - 1)
    return req_to_token[reqs.to(torch.long)[:, None], positions].to(torch.long), valid


class TargetRows:
    """Per target KV location: ``features`` [rows, F], ``tokens`` [rows], ``read`` [rows]."""

    def __init__(
        self, num_rows: int, feature_size: int, dtype: torch.dtype, device: object
    ) -> None:
        self.features = torch.zeros(num_rows, feature_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.read = torch.zeros(num_rows, dtype=torch.bool, device=device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.features, self.tokens, self.read))

    def store(self, locs: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens whose target KV was just written at ``locs``; the drafter has not read
        them (a location SGLang reused holds a new token)."""
        locs = locs.reshape(-1).to(torch.long)
        self.features.index_copy_(0, locs, features.to(self.features.dtype))
        self.tokens.index_copy_(0, locs, tokens.reshape(-1).to(torch.int64))
        self.read.index_fill_(0, locs, False)

    def mark_read(self, locs: torch.Tensor) -> None:
        self.read.index_fill_(0, locs.reshape(-1).to(torch.long), True)

    def unread_tail(self, req_to_token: torch.Tensor, reqs: torch.Tensor, lens: torch.Tensor):
        """Per request, how many of its positions ``0 .. lens-1`` lie at or after the first
        one the drafter has not read (0: all read) -- the positions a catch-up must extend."""
        t = max(int(lens.max()), 1) if lens.numel() else 1
        cols = torch.arange(t, device=lens.device)
        inside = cols[None, :] < lens[:, None]
        locs = req_to_token[reqs.to(torch.long)[:, None], cols[None, :]].to(torch.long)
        unread = inside & ~self.read[torch.where(inside, locs, 0)]
        first = torch.where(unread, cols[None, :], t).amin(dim=1)
        return (lens - first).clamp(min=0)

    def rows(
        self,
        req_to_token: torch.Tensor,
        reqs: torch.Tensor,  # [bs]
        starts: torch.Tensor,  # [bs] first position to read
        counts: torch.Tensor,  # [bs] positions to read (>= 0)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [bs, P, F] and tokens [bs, P] of positions ``starts .. starts+counts-1``,
        left-aligned and zero-padded to the largest count P."""
        locs, valid = locations(req_to_token, reqs, starts, counts)
        locs = torch.where(valid, locs, 0)
        features = self.features[locs] * valid[..., None].to(self.features.dtype)
        return features, torch.where(valid, self.tokens[locs], 0)
