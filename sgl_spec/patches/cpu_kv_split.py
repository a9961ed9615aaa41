"""Patch: on the CPU, a layer's K and V caches are two allocations, not halves of one.

Upstream target: ``sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal``
(SGLang 0.5.23). Where K and V have one shape, upstream stores them as the two halves of one
allocation per layer, so that GPU paged kernels with a single pool base reach V by a block
offset. No CPU kernel reads it that way (SGLang's CPU attention and ours take K and V as two
tensors), but ``torch.compile`` does see it: the attention op writes both halves, two graph
inputs that alias one storage, and the functionalised graph then copies the layer's whole
K+V storage out and back on every forward, which costs more than the forward itself on any
real pool. On a CPU pool this patch allocates each layer's K and V on their own, the same
shapes, dtype and bytes; every other device keeps upstream's layout.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.mem_cache.memory_pool"


def enabled(config: SpecConfig) -> bool:
    return True  # only CPU pools change, and their kernels read K and V as separate tensors


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    pool = getattr(importlib.import_module(TARGET), "MHATokenToKVPool", None)
    create = getattr(pool, "_create_buffers_normal", None)
    if create is None:
        raise RuntimeError(f"{TARGET}.MHATokenToKVPool._create_buffers_normal is gone")
    source = inspect.getsource(create)
    for text in ("self.k_buffer = [buf[0, :rows] for buf in fused]", "self.v_buffer"):
        if text not in source:
            raise RuntimeError(f"{TARGET}: _create_buffers_normal changed ({text!r} gone)")


def shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are views of one allocation."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def split(pool: object) -> bool:
    """Give each layer of ``pool`` (a CPU pool just created, so all zeros) K and V caches of
    their own where they share one allocation; returns whether it changed anything."""
    k_buffer, v_buffer = pool.k_buffer, pool.v_buffer
    changed = False
    for i, (k, v) in enumerate(zip(k_buffer, v_buffer, strict=True)):
        if shared(k, v):  # each half a fresh allocation; the fused one goes with the last view
            k_buffer[i] = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
            v_buffer[i] = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
            changed = True
    return changed


def apply() -> bool:
    pool_cls = importlib.import_module(TARGET).MHATokenToKVPool
    upstream = pool_cls._create_buffers_normal
    if getattr(upstream, "_sgl_spec_patched", False):
        return False

    def _create_buffers_normal(self) -> None:
        upstream(self)
        if torch.device(self.device).type == "cpu" and isinstance(self.k_buffer, list):
            split(self)

    _create_buffers_normal._sgl_spec_patched = True  # type: ignore[attr-defined]
    pool_cls._create_buffers_normal = _create_buffers_normal
    return True
