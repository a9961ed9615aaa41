"""The drafter's own KV cache (paper App. A.2, source 1: "the K keys and values that every
previously committed position produced in its own draft forward").

Rows are indexed by the *target's* KV-pool location of the committed token, so the drafter
cache follows SGLang's allocator with no bookkeeping of its own: a location's row is written
when its token is committed (prefill, or the drafter extend after a verify), shared prefixes
(radix cache) reuse rows that were computed from the same tokens, and a freed location's row is
simply overwritten by its next owner. Each row holds the K slots of one block per layer.
"""

from __future__ import annotations

import torch

from sgl_spec.specblock.drafting import PrefixContext
from sgl_spec.specblock.workspace import DEFAULT_ROOM, KVWorkspace
from sgl_spec.verify.packing import context_visibility


def drafter_kv_shape(config: object) -> tuple[int, int, int, int]:
    """(layers, K, kv heads, head dim) of one drafter KV row from a ``SpecBlockConfig``."""
    layer_cfg = config.llama_config()
    head_dim = getattr(layer_cfg, "head_dim", None) or (
        config.hidden_size // layer_cfg.num_attention_heads
    )
    return config.num_layers, config.block_size, layer_cfg.num_key_value_heads, head_dim


def drafter_kv_bytes_per_row(config: object, dtype: torch.dtype) -> int:
    """Bytes the drafter KV pool spends per target KV location (keys and values)."""
    num_layers, k, heads, head_dim = drafter_kv_shape(config)
    return 2 * num_layers * k * heads * head_dim * torch.empty((), dtype=dtype).element_size()


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

    @property
    def num_rows(self) -> int:
        return int(self.keys[0].shape[0])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def write(
        self,
        locs: torch.Tensor,  # [n] target KV locations of the blocks' start tokens
        kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [bs, n_kv, S*K, hd] each
        rows: torch.Tensor,  # [n] (request, start) flat index into bs*S of each block to keep
    ) -> None:
        """Store the listed blocks of one drafter forward at ``locs``."""
        k = self.block_size
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
        """The drafter context of a batch, gathered once into a step's workspace (its K slots
        per position stay adjacent: one row copy); ``packing.context_visibility`` for the mask.

        The workspace lives in memory the pool keeps between steps (fresh buffers of this size
        cost page faults every step), so a context is valid until the next ``gather``."""
        bs, t = locs.shape
        k = self.block_size
        _, _, n_kv, hd = self.keys[0].shape
        flat = locs.long().reshape(-1)
        workspace = self._workspace(bs, t * k)
        for pools, buffers in ((self.keys, workspace.keys), (self.values, workspace.values)):
            for pool, buffer in zip(pools, buffers, strict=True):
                context = buffer[:, : t * k].view(bs, t, k, n_kv, hd)
                if pool.device.type != "cpu":  # one kernel, not one launch per request
                    context.copy_(pool[flat].view(bs, t, k, n_kv, hd))
                    continue
                # on the CPU each request's contiguous row is gathered straight into it
                # (``pool[flat]`` fills a fresh tensor of the whole batch, page faults
                # included, then copies it: 2-3x slower at 16-32 requests)
                for row, row_locs in zip(context, flat.view(bs, t), strict=True):
                    torch.index_select(pool, 0, row_locs, out=row)
        visible = context_visibility(num_tokens, t, k, last_slot_only)
        return PrefixContext(workspace, visible.to(locs.device))

    def _workspace(self, batch_size: int, columns: int) -> KVWorkspace:
        """A workspace of ``columns`` visible columns and the default room behind them, on the
        pool's scratch memory (grown, never shrunk)."""
        _, _, n_kv, hd = self.keys[0].shape
        shape = (batch_size, columns + DEFAULT_ROOM, n_kv, hd)
        numel = shape[0] * shape[1] * n_kv * hd
        num_buffers = 2 * len(self.keys)
        if self._scratch is None or self._scratch.shape[1] < numel:
            self._scratch = self.keys[0].new_empty(num_buffers, numel)
        views = [self._scratch[i, :numel].view(shape) for i in range(num_buffers)]
        return KVWorkspace(views[: len(self.keys)], views[len(self.keys) :], columns)

    def with_visibility(
        self, context: PrefixContext, num_tokens: torch.Tensor, last_slot_only: bool
    ) -> PrefixContext:
        """``context`` (gathered by ``gather`` for these ``num_tokens``) seen with another
        visibility, without gathering again: the drafter extend after a verify reads the very
        rows the tree rounds before it read, with every slot visible."""
        t = context.num_columns // self.block_size
        visible = context_visibility(num_tokens, t, self.block_size, last_slot_only)
        return PrefixContext(context.kv, visible.to(context.visible.device))
