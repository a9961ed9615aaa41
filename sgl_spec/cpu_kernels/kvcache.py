"""``copy_all_layer_kv_cache_cpu``: move KV rows inside every layer's buffer by raw pointer.

SGLang passes one base pointer and one row stride (bytes) per layer buffer; row ``src_loc[i]``
is copied to row ``tgt_loc[i]``. All sources are read before any target is written, so
overlapping moves (compaction of accepted draft tokens) are safe, as in the Triton kernel.
Where the native library is built, one call moves the rows of every buffer (the PyTorch
version builds a view and two index copies per layer buffer: on a tree verify's compaction it
was ~6% of a served SPECBLOCK step at concurrency 1).
"""

from __future__ import annotations

import ctypes

import torch

from sgl_spec.cpu_kernels import native
from sgl_spec.cpu_kernels.opdef import OpDef


def _rows_view(base_ptr: int, stride_bytes: int, num_rows: int) -> torch.Tensor:
    raw = (ctypes.c_uint8 * (stride_bytes * num_rows)).from_address(base_ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, stride_bytes)


def copy_all_layer_kv_cache(
    data_ptrs: torch.Tensor,  # [num_buffers] int64 base addresses
    strides: torch.Tensor,  # [num_buffers] int64 bytes per row
    tgt_loc: torch.Tensor,  # [n]
    src_loc: torch.Tensor,  # [n]
) -> None:
    if tgt_loc.numel() == 0:
        return
    ops = native.ops()
    if ops is not None and hasattr(ops, "copy_kv_rows"):
        ops.copy_kv_rows(data_ptrs, strides, tgt_loc, src_loc)
        return
    tgt = tgt_loc.long()
    src = src_loc.long()
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _rows_view(int(ptr), int(stride), num_rows)
        rows[tgt] = rows[src].clone()


OPS = [
    OpDef(
        "copy_all_layer_kv_cache_cpu",
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        copy_all_layer_kv_cache,
    ),
]
