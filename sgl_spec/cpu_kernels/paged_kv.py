"""The paged KV layout as the CPU attention ops (``attention.py``) read it: which requests run
together, which pool rows hold their keys, and K/V gathered from those rows -- or viewed in
place when a lone request's rows are consecutive.

Paged layout: ``req_to_token[req_pool_indices[b], j]`` is the KV-pool row of token ``j`` of
request ``b``; ``k_buffer``/``v_buffer`` are ``[pool_size, num_kv_heads, head_dim]``. K and V
are gathered once (``index_select``), or read in place (``pool_view``), and returned as a
head-major view without another copy. A batch whose padding would waste most of the work
(``MAX_PAD``) is split into one batch per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACC = torch.float32  # K, V and queries are read in this dtype (as the model's linear layers)
# Read K/V straight from the pool when a lone request's rows are consecutive
# (``consecutive_start``, ``pool_view``); False always gathers a copy (the tests compare both).
POOL_VIEW = True
# A batch is padded to its longest request (one call, ~20 small ops) unless that scores more
# than MAX_PAD times the real query-key pairs and over SMALL_PAIRS of them (a ragged prefill
# batch); then it runs one request at a time, paying those ops per request.
MAX_PAD = 4.0
SMALL_PAIRS = 1 << 16


@dataclass(frozen=True)
class Batch:
    """Requests attended together: their pool rows, key counts and query rows."""

    req_pool_indices: torch.Tensor  # [B]
    lens: torch.Tensor  # [B] keys per request, int64 (prefix + extend)
    ext: torch.Tensor  # [B] queries per request, int64
    starts: torch.Tensor  # [B] row of each request's first query in q / o, int64
    lens_list: list[int]
    ext_list: list[int]
    start_list: list[int]

    @property
    def uniform(self) -> bool:
        """Every request has the same number of queries, stored back to back in order."""
        n = self.ext_list[0]
        return self.ext_list == [n] * len(self.ext_list) and self.start_list == [
            b * n for b in range(len(self.ext_list))
        ]

    def split(self) -> list[tuple[slice, slice, Batch]]:
        """One batch per request, with the request's query rows and its tree-mask entries
        (an ``[e, e]`` block per request, back to back)."""
        parts, mask_start = [], 0
        for b, (start, n) in enumerate(zip(self.start_list, self.ext_list, strict=True)):
            one = Batch(
                self.req_pool_indices[b : b + 1],
                self.lens[b : b + 1],
                self.ext[b : b + 1],
                self.starts[b : b + 1] - start,
                [self.lens_list[b]],
                [n],
                [0],
            )
            parts.append((slice(start, start + n), slice(mask_start, mask_start + n * n), one))
            mask_start += n * n
        return parts

    def parts(self, batched: bool) -> list[tuple[slice, slice, Batch]]:
        """``split()``, or the whole batch as one part when ``batched``."""
        return [(slice(None), slice(None), self)] if batched else self.split()


def make_batch(
    req_pool_indices: torch.Tensor, lens: torch.Tensor, ext: torch.Tensor, starts: torch.Tensor
) -> Batch:
    """The whole call as one batch (lengths read once into Python lists)."""
    lens, ext, starts = lens.long(), ext.long(), starts.long()
    rows = req_pool_indices.long()
    return Batch(rows, lens, ext, starts, lens.tolist(), ext.tolist(), starts.tolist())


def pad_is_cheap(batch: Batch) -> bool:
    """Whether padding every request to the longest one stays cheap (see ``MAX_PAD``)."""
    padded = len(batch.lens_list) * max(batch.lens_list) * max(batch.ext_list)
    pairs = sum(n * e for n, e in zip(batch.lens_list, batch.ext_list, strict=True))
    return padded <= max(MAX_PAD * pairs, SMALL_PAIRS)


def pool_rows(req_to_token: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[B, L]`` pool rows of each request's keys, padding -> row 0; ``[L]`` positions)."""
    max_len = max(batch.lens_list)
    rows = req_to_token[batch.req_pool_indices, :max_len]
    key_pos = torch.arange(max_len, device=rows.device)
    if min(batch.lens_list) < max_len:
        rows = rows.masked_fill(key_pos[None, :] >= batch.lens[:, None], 0)
    return rows, key_pos


def gather_heads(
    buffer: torch.Tensor,  # [pool, Hkv, D]
    rows: torch.Tensor,  # [B, L] pool rows
    scale: float,
    override: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    start: int | None = None,
) -> torch.Tensor:
    """``buffer[rows] * scale`` as a ``[B, Hkv, L, D]`` view in ``ACC``, gathered once.

    ``override = (b, j, values [T, Hkv, D])`` replaces keys ``(b[t], j[t])`` by ``values[t]``
    (the extend K/V passed to the op, which the pool may not hold). ``start``
    (``consecutive_start``) lets it read the pool in place instead (``pool_view``)."""
    num, length = rows.shape
    heads, dim = buffer.shape[1], buffer.shape[2]
    if start is not None and buffer.dtype == ACC and scale == 1.0:
        view = pool_view(buffer, start, length, override)
        if view is not None:
            return view.transpose(1, 2)
    gathered = buffer.index_select(0, rows.reshape(-1)).view(num, length, heads, dim)
    if gathered.dtype != ACC:
        gathered = gathered.to(ACC)
    if override is not None:
        b, j, values = override
        gathered[b, j] = values.to(ACC)
    if scale != 1.0:
        gathered.mul_(scale)
    return gathered.transpose(1, 2)


def consecutive_start(rows: torch.Tensor) -> int | None:  # [B, L] pool rows
    """The first pool row when the batch is one request whose keys sit in consecutive pool rows
    in order (a lone request usually gets its slots that way); None otherwise. Checked once
    per call, for K and V alike."""
    if not POOL_VIEW or rows.shape[0] != 1:
        return None
    length = rows.shape[1]
    first = int(rows[0, 0])
    expected = torch.arange(first, first + length, dtype=rows.dtype, device=rows.device)
    if length > 1 and not torch.equal(rows[0], expected):
        return None
    return first


def pool_view(
    buffer: torch.Tensor,  # [pool, Hkv, D]
    start: int,
    length: int,
    override: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor | None:
    """Pool rows ``start .. start + length`` as a ``[1, L, Hkv, D]`` view of the pool itself;
    with ``override``, only if the pool already holds those values (the backend saved the
    extend K/V before the call). None otherwise: the caller gathers a copy."""
    if start + length > buffer.shape[0]:
        return None
    view = buffer[start : start + length].unsqueeze(0)
    if override is not None:
        _, j, values = override
        if not torch.equal(view[0, j], values.to(buffer.dtype)):
            return None
    return view
