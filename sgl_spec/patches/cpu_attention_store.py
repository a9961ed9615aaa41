"""Patch: a short extend's KV store and attention in one native call on CPU hosts.

Upstream target: ``sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend``
(SGLang 0.5.23). For an extend (prefill, and the target-verify and draft passes of every
speculative step) ``forward_extend`` first stores the new K/V through the pool's
``set_kv_buffer`` (seven Python frames down to ``store_cache_cpu``, two row copies) and then
calls ``extend_attention_cpu`` (our Python op, which then calls the native kernel). A decode
does both in one kernel call. On a verify pass of a few rows that wrapping costs more than the
copies and the attention themselves (RESULTS.md, MTP_LORA's step profile). With this patch,
where the call is the plain case, the backend calls ``sgl_spec_native.store_extend_attention``
directly: the same row copies into the same pool rows, then the same native attention, so
outputs and cache contents are the ones the unpatched path produces, bit for bit
(``tests/unit/test_cpu_attention_store.py``).

The plain case: float32 q/k/v and a float32 ``MHATokenToKVPool`` in SGLang's default row
layout (no quantized, HND, page-major or sliding-window pool), K/V given and to be saved, no
cross-attention or encoder-only layer, equal K and V head dims, an extend the native kernel
takes (``attention_native.takes_extend``: few tokens, or few a request, as a verify has), the
native library loaded. Anything else takes SGLang's own method. ``SGLSPEC_CPU_ATTN_STORE=0``
turns the patch off.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from types import ModuleType

import torch

from sgl_spec.config import SpecConfig
from sgl_spec.cpu_kernels import attention_native, native

TARGET = "sglang.srt.layers.attention.intel_amx_backend"
ENV_SWITCH = "SGLSPEC_CPU_ATTN_STORE"
_PARAMS = ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache", "sinks"]
_MARK = "_sgl_spec_attention_store"  # on the wrapper: installed
_PLAIN = "_sgl_spec_plain_pool"  # on a backend: its pool is plain (fixed for its life)


def enabled(config: SpecConfig) -> bool:
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: expected 1 or 0")
    return value in ("1", "on", "true")


def _module() -> ModuleType:
    import importlib

    return importlib.import_module(TARGET)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    cls = getattr(_module(), "IntelAMXAttnBackend", None)
    if cls is None:
        raise RuntimeError(f"{TARGET}.IntelAMXAttnBackend is gone")
    method = getattr(cls.forward_extend, "__wrapped__", cls.forward_extend)
    params = list(inspect.signature(method).parameters)
    if params != _PARAMS:
        raise RuntimeError(f"{TARGET}.IntelAMXAttnBackend.forward_extend params: {params}")
    for name in ("extend_metadata", "token_to_kv_pool", "req_to_token_pool"):
        if name not in inspect.getsource(method):
            raise RuntimeError(
                f"{TARGET}.IntelAMXAttnBackend.forward_extend no longer reads {name}"
            )


def plain_pool(pool: object) -> bool:
    """A float32 ``MHATokenToKVPool`` whose K/V rows are ``[pool_row, heads, dim]`` buffers:
    what ``set_kv_buffer`` would fill by plain row copies."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return (
        type(pool) is MHATokenToKVPool
        and not pool.is_quantized_kv_cache
        and not pool.use_hnd
        and pool.kv_cache_layout == "nhd"
        and pool.dtype == pool.store_dtype == torch.float32
    )


def _plain_call(backend, q, k, v, layer, forward_batch, save_kv_cache, encoder_only) -> bool:
    plain = backend.__dict__.get(_PLAIN)
    if plain is None:
        plain = plain_pool(backend.token_to_kv_pool) and not backend.use_sliding_window_kv_pool
        backend.__dict__[_PLAIN] = plain
    return (
        plain
        and save_kv_cache
        and k is not None
        and v is not None
        and forward_batch.out_cache_loc is not None
        and backend.extend_metadata is not None
        and not layer.is_cross_attention
        and layer.attn_type != encoder_only
        and layer.qk_head_dim == layer.v_head_dim
        and attention_native.takes_extend(q.shape[0], _longest(backend, q.shape[0]))
        and q.dtype == k.dtype == v.dtype == torch.float32
        and k.dim() == v.dim() == 3
        and k.stride(2) == v.stride(2) == 1
        # the kernels take no tree mask with a sliding window (nor does the PyTorch path)
        and (backend.extend_metadata[3] is None or layer.sliding_window_size < 0)
    )


def _longest(backend, num_tokens: int) -> int:
    """The most extend tokens of one request: the backend's ``max_extend_len`` of this forward
    (a verify's: its draft tokens per request), else all of them."""
    _, longest = backend.forward_metadata  # as SGLang's forward_extend reads it
    return num_tokens if longest is None else int(longest)


def storing(original: Callable) -> Callable:
    """``forward_extend`` through ``store_extend_attention`` in the plain case."""
    encoder_only = _module().AttentionType.ENCODER_ONLY

    @functools.wraps(original)
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        ops = native.ops()
        if ops is None or not _plain_call(
            self, q, k, v, layer, forward_batch, save_kv_cache, encoder_only
        ):
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, sinks)
        seq_lens, extend_seq_lens, extend_start_loc, tree_mask = self.extend_metadata
        pool = self.token_to_kv_pool
        o = torch.empty_like(q)
        ops.store_extend_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k, v,
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            forward_batch.out_cache_loc, self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
            layer.scaling, layer.k_scale_float or 1.0, layer.v_scale_float or 1.0,
            layer.logit_cap, layer.sliding_window_size + 1, sinks, tree_mask, True,
        )  # fmt: skip
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    setattr(forward_extend, _MARK, True)
    return forward_extend


def apply() -> bool:
    """Wrap ``forward_extend``; idempotent. False (nothing changed) without the native op."""
    check()
    ops = native.ops()
    if ops is None or not hasattr(ops, "store_extend_attention"):
        return False
    cls = _module().IntelAMXAttnBackend
    if not getattr(cls.forward_extend, _MARK, False):
        cls.forward_extend = storing(cls.forward_extend)
    return True
