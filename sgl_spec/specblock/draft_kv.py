"""The drafter's own KV cache (paper App. A.2, source 1: "the K keys and values that every
previously committed position produced in its own draft forward").

Rows are indexed by the *target's* KV-pool location of the committed token, so the drafter
cache follows SGLang's allocator with no bookkeeping of its own: a location's row is written
when its token is committed (prefill, or the drafter extend after a verify), shared prefixes
(radix cache) reuse rows that were computed from the same tokens, and a freed location's row is
simply overwritten by its next owner. Each row holds the K slots of one block per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_spec.cpu_kernels import native
from sgl_spec.specblock.drafting import PrefixContext
from sgl_spec.specblock.workspace import DEFAULT_ROOM, KVWorkspace
from sgl_spec.verify.packing import context_visibility

# Columns of slack a CPU workspace gets beyond what its step needs, so that its layout (the row
# stride) stays put while the contexts grow and a step's gather copies only the positions
# committed since the last one (``DrafterKVPool.gather``).
GROWTH_COLUMNS = 256
# Per row: which write last touched it (``DrafterKVPool._written_at``, int64).
WRITTEN_AT_BYTES = 8


def drafter_kv_shape(config: object) -> tuple[int, int, int, int]:
    """(layers, K, kv heads, head dim) of one drafter KV row from a ``SpecBlockConfig``."""
    layer_cfg = config.llama_config()
    head_dim = getattr(layer_cfg, "head_dim", None) or (
        config.hidden_size // layer_cfg.num_attention_heads
    )
    return config.num_layers, config.block_size, layer_cfg.num_key_value_heads, head_dim


def drafter_kv_bytes_per_row(config: object, dtype: torch.dtype) -> int:
    """Bytes the drafter KV pool spends per target KV location (keys, values, write stamp)."""
    num_layers, k, heads, head_dim = drafter_kv_shape(config)
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * k * heads * head_dim * size + WRITTEN_AT_BYTES


@dataclass
class _Seen:
    """What the CPU workspace holds per row since the last ``gather`` (updated by each)."""

    capacity: int  # columns per row of the workspace's layout
    locs: torch.Tensor  # [bs, capacity // K] int64, the locations gathered into each row
    num_tokens: torch.Tensor  # [bs] int64, real entries of each row (0: holds nothing)
    generation: int  # ``DrafterKVPool._generation`` at the last gather


def _native_ops() -> object | None:
    """Our native kernels where they have the pool's calls (``drafter_kv.cpp``), else None:
    the PyTorch ops serve."""
    ops = native.ops()
    return ops if ops is not None and hasattr(ops, "drafter_gather") else None


class DrafterKVPool:
    """Per layer ``[num_rows, K, n_kv, head_dim]`` keys and values."""

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_rows, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._scratch: torch.Tensor | None = None  # [2 * layers, n] the step's workspace memory
        # which write last touched each row: a gathered row written since is gathered again
        self._written_at = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._generation = 0
        self._seen: _Seen | None = None

    @property
    def num_rows(self) -> int:
        return int(self.keys[0].shape[0])

    def nbytes(self) -> int:
        rows = (*self.keys, *self.values, self._written_at)
        return sum(t.numel() * t.element_size() for t in rows)

    def write(
        self,
        locs: torch.Tensor,  # [n] target KV locations of the blocks' start tokens
        kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [bs, n_kv, S*K, hd] each
        rows: torch.Tensor,  # [n] (request, start) flat index into bs*S of each block to keep
    ) -> None:
        """Store the listed blocks of one drafter forward at ``locs`` (one native call where
        built and the dtypes agree)."""
        k = self.block_size
        self._generation += 1
        ops = _native_ops() if self.keys[0].device.type == "cpu" else None
        if ops is not None and all(t.dtype == self.keys[0].dtype for pair in kv for t in pair):
            new = [key for key, _ in kv] + [value for _, value in kv]
            ops.drafter_kv_write(
                locs, rows, new, [*self.keys, *self.values], self._written_at, self._generation
            )
            return
        self._written_at[locs.long()] = self._generation
        for layer, (key, value) in enumerate(kv):
            for pool, new in ((self.keys[layer], key), (self.values[layer], value)):
                bs, n_kv, sk, hd = new.shape
                blocks = new.view(bs, n_kv, sk // k, k, hd).permute(0, 2, 3, 1, 4)
                pool[locs.long()] = blocks.reshape(-1, k, n_kv, hd)[rows.long()].to(pool.dtype)

    def gather(
        self,
        locs: torch.Tensor,  # [bs, T] locations of each request's committed tokens, padded
        num_tokens: torch.Tensor,  # [bs] real entries of each row
        last_slot_only: bool,
    ) -> PrefixContext:
        """The drafter context of a batch, gathered into a step's workspace (its K slots per
        position stay adjacent: one row copy); ``packing.context_visibility`` for the mask.

        The workspace lives in memory the pool keeps between steps (fresh buffers of this size
        cost page faults every step), so a context is valid until the next ``gather``. On the
        CPU the workspace keeps its layout while the contexts grow, and a gather copies per row
        only what the workspace does not hold already: the positions from the first one whose
        location differs from what the last gather put there, lies past either gather's real
        entries, or has been written since (one native call where built)."""
        bs, t = locs.shape
        k = self.block_size
        _, _, n_kv, hd = self.keys[0].shape
        flat = locs.long()
        if self.keys[0].device.type != "cpu":  # one kernel, not one launch per request
            workspace, _ = self._workspace(bs, t * k + DEFAULT_ROOM)
            for pools, buffers in ((self.keys, workspace.keys), (self.values, workspace.values)):
                for pool, buffer in zip(pools, buffers, strict=True):
                    buffer[:, : t * k].view(bs, t, k, n_kv, hd).copy_(
                        pool[flat.reshape(-1)].view(bs, t, k, n_kv, hd)
                    )
            visible = context_visibility(num_tokens, t, k, last_slot_only).to(locs.device)
        else:
            workspace, seen = self._held(bs, t)
            self._seen = None  # until the copy below is done: a failure leaves nothing trusted
            ops = _native_ops()
            if ops is not None:
                visible = ops.drafter_gather(
                    flat.contiguous(), num_tokens.to(torch.int64).contiguous(), seen.locs,
                    seen.num_tokens, self._written_at, seen.generation,
                    [*self.keys, *self.values], [*workspace.keys, *workspace.values],
                    last_slot_only,
                )  # fmt: skip
            else:
                self._copy_new(flat, num_tokens, seen, workspace)
                visible = context_visibility(num_tokens, t, k, last_slot_only)
            seen.generation = self._generation
            self._seen = seen
        workspace.length = t * k
        return PrefixContext(workspace, visible)

    def _held(self, bs: int, t: int) -> tuple[KVWorkspace, _Seen]:
        """The CPU workspace for ``bs`` rows of ``t`` positions and what it holds: the last
        gather's, unless the batch size changed or the contexts outgrew its layout (then a new
        layout, holding nothing)."""
        k = self.block_size
        seen = self._seen
        if seen is None or seen.locs.shape[0] != bs or t * k + DEFAULT_ROOM > seen.capacity:
            seen = None
        capacity = seen.capacity if seen else t * k + DEFAULT_ROOM + GROWTH_COLUMNS
        workspace, fresh = self._workspace(bs, capacity)
        if seen is None or fresh:
            locs = torch.zeros((bs, capacity // k + 1), dtype=torch.int64)
            seen = self._seen = _Seen(capacity, locs, locs[:, 0].clone(), self._generation)
        return workspace, seen

    def _copy_new(
        self, flat: torch.Tensor, num_tokens: torch.Tensor, seen: _Seen, workspace: KVWorkspace
    ) -> None:
        """``drafter_gather`` in PyTorch ops (no native build): each row's positions from the
        first one the workspace does not hold, straight from the pool (``pool[locs]`` would
        fill a fresh tensor of the whole batch, then copy it: 2-3x slower at 16-32)."""
        bs, t = flat.shape
        k = self.block_size
        _, _, n_kv, hd = self.keys[0].shape
        limit = torch.minimum(num_tokens.to(torch.int64), seen.num_tokens).clamp(max=t)
        held = (
            (flat == seen.locs[:, :t])
            & (torch.arange(t)[None, :] < limit[:, None])
            & (self._written_at[flat] <= seen.generation)
        )
        starts = held.to(torch.int64).cumprod(dim=1).sum(dim=1).tolist()
        for pools, buffers in ((self.keys, workspace.keys), (self.values, workspace.values)):
            for pool, buffer in zip(pools, buffers, strict=True):
                for row, start in enumerate(starts):
                    if start < t:
                        out = buffer[row, start * k : t * k].view(t - start, k, n_kv, hd)
                        torch.index_select(pool, 0, flat[row, start:], out=out)
        seen.locs[:, :t] = flat
        seen.num_tokens.copy_(num_tokens)

    def forget(self) -> None:
        """The next ``gather`` copies every position (nothing is taken from the workspace)."""
        self._seen = None

    def _workspace(self, batch_size: int, capacity: int) -> tuple[KVWorkspace, bool]:
        """A workspace of ``capacity`` columns per row on the pool's scratch memory (grown,
        never shrunk), none of them visible yet; and whether the scratch is new (holds
        nothing gathered)."""
        _, _, n_kv, hd = self.keys[0].shape
        shape = (batch_size, capacity, n_kv, hd)
        numel = shape[0] * shape[1] * n_kv * hd
        num_buffers = 2 * len(self.keys)
        fresh = self._scratch is None or self._scratch.shape[1] < numel
        if fresh:
            self._scratch = self.keys[0].new_empty(num_buffers, numel)
        views = [self._scratch[i, :numel].view(shape) for i in range(num_buffers)]
        return KVWorkspace(views[: len(self.keys)], views[len(self.keys) :], 0), fresh

    def with_visibility(
        self, context: PrefixContext, num_tokens: torch.Tensor, last_slot_only: bool
    ) -> PrefixContext:
        """``context`` (gathered by ``gather`` for these ``num_tokens``) seen with another
        visibility, without gathering again: the drafter extend after a verify reads the very
        rows the tree rounds before it read, with every slot visible."""
        t = context.num_columns // self.block_size
        ops = _native_ops() if context.visible.device.type == "cpu" else None
        if ops is not None:
            visible = ops.drafter_visibility(num_tokens, t, self.block_size, last_slot_only)
        else:
            visible = context_visibility(num_tokens, t, self.block_size, last_slot_only)
        return PrefixContext(context.kv, visible.to(context.visible.device))
