"""Which attention calls the native kernels (``csrc/ops.cpp``) take, and the calls.

``attention.decode_attention`` / ``extend_attention`` ask here first; each returns True when
it ran the call natively (float32 tensors in the ``[rows, heads, dim]`` layout the kernels
read, unit inner stride, the library built), else False and the PyTorch path serves.
"""

from __future__ import annotations

import torch

from sgl_spec.cpu_kernels import native

# Most extend tokens (all requests) the native kernel takes: the verify and draft passes of
# small batches. Beyond that PyTorch's fused attention, which blocks over queries as a GEMM
# does, is as fast or faster for a long extend of a few requests (a prefill; RESULTS.md,
# "Native CPU kernels").
NATIVE_MAX_EXTEND_TOKENS = 16
# Except where every request extends by few tokens (the verify of a batch, a draft model's
# extend): the native kernel reads each request's paged K/V once for all its rows, where the
# PyTorch path gathers them into a padded copy first. Measured per layer, the PyTorch path was
# slower for every batch of 1-32 requests of 2-16 tokens (1.2-12x), and faster for 4 requests
# of 32 and on prefills (``benchmarks/attention_routes.py``; RESULTS.md, 2026-12-05).
NATIVE_MAX_ROWS_PER_REQUEST = 16


def takes_extend(num_tokens: int, longest: int) -> bool:
    """Whether the native kernel serves an extend of ``num_tokens`` tokens whose longest
    request extends by ``longest``."""
    return num_tokens <= NATIVE_MAX_EXTEND_TOKENS or longest <= NATIVE_MAX_ROWS_PER_REQUEST


def fits(*tensors: torch.Tensor | None) -> bool:
    """Float32 ``[rows, heads, dim]`` with unit inner stride (``None``, an absent pair of new
    K/V, is fine: the pool holds them)."""
    return all(
        t is None or (t.dtype == torch.float32 and t.dim() == 3 and t.stride(2) == 1)
        for t in tensors
    )


def decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    output: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scales: tuple[float, float, float],  # sm_scale, key_scale, value_scale
    logit_cap: float,
    window: int,
    sinks: torch.Tensor | None,
) -> bool:
    ops = native.ops()
    if ops is None or not fits(query, output, k_cache, v_cache, key, value):
        return False
    ops.decode_attention(
        query, k_cache, v_cache, output, key, value, loc, req_to_token, req_pool_indices,
        seq_lens, *scales, logit_cap, window, sinks,
    )  # fmt: skip
    return True


def extend(
    q_extend: torch.Tensor,
    kv_extend: tuple[torch.Tensor | None, torch.Tensor | None],
    o_extend: torch.Tensor,
    kv_buffer: tuple[torch.Tensor, torch.Tensor],
    req_to_token: torch.Tensor,
    lens: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scales: tuple[float, float, float],  # sm_scale, key_scale, value_scale
    logit_cap: float,
    window: int,
    sinks: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    is_causal: bool,
    longest: int,
) -> bool:
    """``lens``: req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc;
    ``longest``: the most extend tokens of one request."""
    ops = native.ops()
    if (
        ops is None
        or not takes_extend(q_extend.shape[0], longest)
        or not fits(q_extend, o_extend, *kv_buffer, *kv_extend)
    ):
        return False
    ops.extend_attention(
        q_extend, *kv_extend, o_extend, *kv_buffer, req_to_token, *lens, *scales, logit_cap,
        window, sinks, tree_mask, is_causal,
    )  # fmt: skip
    return True
