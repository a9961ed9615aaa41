"""Patch ``cpu_attention_store`` and its kernel: a short extend's KV store and attention in one
native call compute what SGLang's ``forward_extend`` (``set_kv_buffer``, then
``extend_attention_cpu``) computes, output and cache bit for bit; calls outside the plain case
take SGLang's method. Also the native ``assign_req_to_token_pool`` against its PyTorch version.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sgl_kernel  # noqa: F401  (registers the fallback ops on this CPU host)
import torch

from sgl_spec.cpu_kernels import attention_native, native, spec_ops
from sgl_spec.patches import cpu_attention_store as patch
from tests.helpers.native_kernels import require_native

HEADS, KV_HEADS, DIM, LAYERS, POOL = 8, 2, 16, 2, 96


@pytest.fixture(scope="module")
def ops():
    return require_native()


def _backend(dtype=torch.float32):
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(POOL, 1, dtype, KV_HEADS, DIM, LAYERS, "cpu", False)
    gen = torch.Generator().manual_seed(5)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    backend = object.__new__(IntelAMXAttnBackend)  # the attributes forward_extend reads
    backend.token_to_kv_pool = pool
    backend.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(3, 64, dtype=torch.int32))
    backend.use_mla = False
    backend.use_sliding_window_kv_pool = False
    backend.swa_out_cache_loc = None
    backend.extend_attention_fwd = torch.ops.sgl_kernel.extend_attention_cpu
    return backend


def _verify_batch(backend, tree: bool, tokens: int = 4):
    """Two requests (pool rows 1 and 2) with 20 and 33 committed tokens, ``tokens`` new ones
    each, like a target-verify pass (a tree mask: each token sees itself and token 0)."""
    gen = torch.Generator().manual_seed(7)
    prefix = torch.tensor([20, 33])
    r2t = backend.req_to_token_pool.req_to_token
    perm = torch.randperm(POOL - 1, generator=gen) + 1
    used = 0
    for b, n in enumerate((prefix + tokens).tolist()):
        r2t[b + 1, :n] = perm[used : used + n].to(torch.int32)
        used += n
    loc = torch.cat([r2t[b + 1, p : p + tokens].long() for b, p in enumerate(prefix.tolist())])
    mask = None
    if tree:
        one = torch.eye(tokens, dtype=torch.bool)
        one[:, 0] = True
        mask = one.reshape(-1).repeat(2)
    backend.extend_metadata = (
        prefix + tokens,
        torch.full((2,), tokens, dtype=torch.int32),
        torch.tensor([0, tokens], dtype=torch.int32),
        mask,
    )
    backend.forward_metadata = (None, tokens)
    batch = SimpleNamespace(
        out_cache_loc=loc, req_pool_indices=torch.tensor([1, 2]), encoder_lens=None
    )
    n = 2 * tokens
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    return q.contiguous(), k.view(n, KV_HEADS, DIM), v.view(n, KV_HEADS, DIM), batch


def _layer(layer_id: int = 1):
    from sglang.srt.layers.radix_attention import AttentionType

    return SimpleNamespace(
        layer_id=layer_id, qk_head_dim=DIM, v_head_dim=DIM, tp_q_head_num=HEADS,
        is_cross_attention=False, attn_type=AttentionType.DECODER, scaling=DIM**-0.5,
        logit_cap=0.0, sliding_window_size=-1, k_scale_float=None, v_scale_float=None,
    )  # fmt: skip


def _run(method, backend, q, k, v, batch, layer):
    out = method(backend, q, k, v, layer, batch)
    pool = backend.token_to_kv_pool
    return out, pool.k_buffer[layer.layer_id].clone(), pool.v_buffer[layer.layer_id].clone()


@pytest.mark.parametrize("tree", [True, False])
def test_patched_forward_extend_equals_sglangs(ops, tree) -> None:
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend

    original = getattr(IntelAMXAttnBackend.forward_extend, "__wrapped__", None)
    original = original or IntelAMXAttnBackend.forward_extend
    patched = patch.storing(original)
    results = []
    for method in (original, patched):
        backend = _backend()
        q, k, v, batch = _verify_batch(backend, tree)
        results.append(_run(method, backend, q, k, v, batch, _layer()))
    for want, got in zip(results[0], results[1], strict=True):
        assert torch.equal(want, got)
    untouched = _backend().token_to_kv_pool.k_buffer[1]
    assert not torch.equal(results[1][1], untouched)  # the new keys were stored


def test_calls_outside_the_plain_case_take_sglangs_method(ops) -> None:
    calls = []

    def original(self, q, k, v, layer, batch, save_kv_cache=True, sinks=None):
        calls.append(save_kv_cache)
        return "sglang"

    patched = patch.storing(original)
    backend = _backend()
    q, k, v, batch = _verify_batch(backend, tree=True)
    assert patched(backend, q, k, v, _layer(), batch, False) == "sglang"  # nothing to store
    longer = _backend()  # past NATIVE_MAX_EXTEND_TOKENS rows, each request past the native's
    tokens = attention_native.NATIVE_MAX_ROWS_PER_REQUEST + 1
    long_q, long_k, long_v, long_batch = _verify_batch(longer, tree=False, tokens=tokens)
    assert patched(longer, long_q, long_k, long_v, _layer(), long_batch) == "sglang"
    cross = SimpleNamespace(**{**vars(_layer()), "is_cross_attention": True})
    assert patched(backend, q, k, v, cross, batch) == "sglang"
    windowed = SimpleNamespace(**{**vars(_layer()), "sliding_window_size": 8})
    assert patched(backend, q, k, v, windowed, batch) == "sglang"  # a tree mask and a window
    half = _backend(torch.bfloat16)  # a pool set_kv_buffer would convert into
    q2, k2, v2, batch2 = _verify_batch(half, tree=True)
    assert patched(half, q2, k2, v2, _layer(), batch2) == "sglang"
    assert len(calls) == 5
    assert patched(backend, q, k, v, _layer(), batch) is not None and len(calls) == 5


def test_store_extend_attention_rejects_rows_outside_the_pool(ops) -> None:
    backend = _backend()
    q, k, v, batch = _verify_batch(backend, tree=True)
    batch.out_cache_loc = batch.out_cache_loc.clone()
    batch.out_cache_loc[3] = POOL + 5
    with pytest.raises(RuntimeError, match="KV row out of range"):
        patch.storing(lambda *a: None)(backend, q, k, v, _layer(), batch)


def test_switch(monkeypatch) -> None:
    for value, on in (("1", True), ("0", False), ("off", False)):
        monkeypatch.setenv(patch.ENV_SWITCH, value)
        assert patch.enabled(None) is on
    monkeypatch.setenv(patch.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match=patch.ENV_SWITCH):
        patch.enabled(None)


@pytest.mark.parametrize("table", [torch.int32, torch.int64])
def test_native_assign_req_to_token_pool_equals_pytorch(ops, monkeypatch, table) -> None:
    gen = torch.Generator().manual_seed(11)
    rpi = torch.tensor([3, 0, 5, 1])
    start = torch.tensor([7, 0, 30, 12], dtype=torch.int32)
    end = torch.tensor([10, 5, 30, 19], dtype=torch.int64)  # an empty segment too
    slots = torch.randint(0, 10_000, (3 + 5 + 7,), generator=gen)
    tables = [torch.full((6, 40), -1, dtype=table) for _ in range(2)]
    spec_ops.assign_req_to_token_pool(rpi, tables[0], start, end, slots, 40)
    monkeypatch.setitem(native._state, "ops", None)
    spec_ops.assign_req_to_token_pool(rpi, tables[1], start, end, slots, 40)
    assert torch.equal(tables[0], tables[1]) and (tables[0] != -1).sum() == 15
    with pytest.raises(RuntimeError, match="out of range"):
        ops.assign_req_to_token_pool(rpi, tables[0], start, end + 30, slots, 40)
    with pytest.raises(RuntimeError, match="out of range"):  # fewer slots than the segments
        ops.assign_req_to_token_pool(rpi, tables[0], start, end, slots[:-1], 40)
