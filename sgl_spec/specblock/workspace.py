"""The keys and values one decode step's drafter forwards attend to, in one buffer per layer.

A step's forwards all read the same verified-prefix context (``draft_kv.DrafterKVPool.gather``)
and each tree round also reads the blocks of the rounds before it (``drafting`` module
docstring). Rather than concatenating the context with every forward's new keys (a copy of the
whole context per layer and forward), the context is gathered once into the front of a buffer
with room behind it: a forward writes its own block's keys right after the visible length and
attends to a view of ``[:length + its own]``; a tree round then moves the length past its keys
so the next round sees them, and the extend after the verify moves it back to the prefix.

Rows are ``[bs, capacity, n_kv, head_dim]``: a committed position's K slots are adjacent, as in
the pool, so the gather is one row copy; attention reads the ``[bs, n_kv, len, head_dim]``
transposed view (the layout HF's own projections produce).
"""

from __future__ import annotations

import torch

from sgl_spec.specblock.mask import ContextKV

DEFAULT_ROOM = 64  # columns behind the context; a step that needs more grows the buffer


class KVWorkspace:
    """Per layer key and value rows ``[bs, capacity, n_kv, head_dim]``; the first ``length``
    columns are what the next forward sees ahead of its own block."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        if len(keys) != len(values) or not keys:
            raise ValueError("KVWorkspace needs one key and one value buffer per layer")
        if not 0 <= length <= keys[0].shape[1]:
            raise ValueError(f"length {length} outside the buffer's {keys[0].shape[1]} columns")
        self.keys = keys
        self.values = values
        self.length = length

    @classmethod
    def empty(
        cls,
        num_layers: int,
        batch_size: int,
        columns: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        room: int = DEFAULT_ROOM,
    ) -> KVWorkspace:
        """Uninitialised buffers of ``columns + room`` columns, the first ``columns`` visible
        (the caller fills them)."""
        shape = (batch_size, columns + room, num_kv_heads, head_dim)
        make = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
        return cls(make[:num_layers], make[num_layers:], columns)

    @classmethod
    def from_context(cls, kv: ContextKV, room: int = DEFAULT_ROOM) -> KVWorkspace:
        """A workspace holding per-layer ``[bs, n_kv, C, hd]`` context keys and values."""
        bs, n_kv, c, hd = kv[0][0].shape
        ws = cls.empty(len(kv), bs, c, n_kv, hd, kv[0][0].dtype, kv[0][0].device, room)
        for layer, (key, value) in enumerate(kv):
            ws.keys[layer][:, :c].copy_(key.transpose(1, 2))
            ws.values[layer][:, :c].copy_(value.transpose(1, 2))
        return ws

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[1])

    def context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The visible keys and values of ``layer`` as ``[bs, n_kv, length, hd]`` views."""
        end = self.length
        return self.keys[layer][:, :end].transpose(1, 2), self.values[layer][:, :end].transpose(
            1, 2
        )

    def append(
        self,
        layer: int,
        key: torch.Tensor,  # [bs, n_kv, n, hd] the forward's own block
        value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [bs, n_kv, length + n, hd] views
        """Write a forward's own keys behind the visible columns (``length`` does not move:
        every layer of the forward writes at the same place) and return what it attends to."""
        n = key.shape[2]
        if key.shape[0] != self.batch_size:
            raise ValueError(f"batch {key.shape[0]} != the workspace's {self.batch_size}")
        self.ensure_room(self.length + n)
        start, end = self.length, self.length + n
        self.keys[layer][:, start:end].copy_(key.transpose(1, 2))
        self.values[layer][:, start:end].copy_(value.transpose(1, 2))
        return self.keys[layer][:, :end].transpose(1, 2), self.values[layer][:, :end].transpose(
            1, 2
        )

    def ensure_room(self, columns: int) -> None:
        """Grow the buffers (keeping the visible columns) to hold at least ``columns``."""
        if columns <= self.capacity:
            return
        grown = max(columns, 2 * self.capacity)
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                new = old.new_empty(old.shape[0], grown, *old.shape[2:])
                new[:, : self.length].copy_(old[:, : self.length])
                store[layer] = new
