"""The native CPU kernels (``sgl_spec/cpu_kernels/csrc/ops.cpp``) against the PyTorch ops.

The attention kernels are also checked against the float64 reference by
``test_cpu_attention*.py`` (every test there runs on both). Here: the element-wise kernels
round exactly as PyTorch does (RoPE, the residual add), reductions agree to float32 rounding;
a request's attention does not depend on the batch; bad indices raise instead of reading
outside the pool; the build is keyed by its source and can be turned off.
"""

from __future__ import annotations

import pytest
import sgl_kernel  # noqa: F401  (registers the fallback ops on this CPU host)
import torch

from sgl_spec.cpu_kernels import attention, attention_native, kvcache, layers, native
from tests.helpers.native_kernels import cos_sin_cache, require_native


@pytest.fixture(scope="module")
def ops():
    return require_native()


def test_rope_rounds_as_pytorch(ops, monkeypatch) -> None:
    """Strided views of a fused QKV output (what SGLang passes) and 3-d tensors."""
    gen = torch.Generator().manual_seed(0)
    cache = cos_sin_cache(512, 64)
    qkv = torch.randn(7, 8 * 64 + 2 * 2 * 64, generator=gen)
    q, k, _ = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1)
    pos = torch.randint(0, 512, (7,), generator=gen)
    got = torch.ops.sgl_kernel.rotary_embedding_cpu(pos, q, k, 64, cache, True)
    monkeypatch.setitem(native._state, "ops", None)
    want = torch.ops.sgl_kernel.rotary_embedding_cpu(pos, q, k, 64, cache, True)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert torch.equal(g, w)
    q3, k3 = q.reshape(7, 8, 64).contiguous(), k.reshape(7, 2, 64).contiguous()
    got3 = ops.rope_neox(pos, q3, k3, 64, cache)
    assert torch.equal(got3[0], want[0].view(7, 8, 64))
    assert torch.equal(got3[1], want[1].view(7, 2, 64))


def test_rope_rejects_positions_past_the_cache(ops) -> None:
    cache = cos_sin_cache(16, 64)
    q, k = torch.randn(2, 64), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rope_neox(torch.tensor([3, 16]), q, k, 64, cache)


def test_rmsnorm_and_fused_add(ops) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 512, generator=gen) * 3
    w = torch.randn(512, generator=gen)
    r = torch.randn(5, 512, generator=gen)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-6), layers._rms(x, w, 1e-6), rtol=1e-6, atol=1e-6)  # fmt: skip
    x1, r1, x2, r2 = x.clone(), r.clone(), x.clone(), r.clone()
    layers.fused_add_rmsnorm(x1, r1, w, 1e-6)  # native
    r2.add_(x2)
    x2.copy_(layers._rms(r2, w, 1e-6))
    assert torch.equal(r1, r2)  # the residual add rounds as PyTorch's
    torch.testing.assert_close(x1, x2, rtol=1e-6, atol=1e-6)
    # a row's result does not depend on the other rows of the call
    assert torch.equal(ops.rmsnorm(x[2:3], w, 1e-6), ops.rmsnorm(x, w, 1e-6)[2:3])


def test_other_dtypes_take_the_pytorch_path(ops) -> None:
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert layers.rmsnorm(x, w, 1e-6).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="float32"):
        ops.rmsnorm(x, w, 1e-6)


def _pool(gen: torch.Generator, lens: list[int], pool: int = 2048, index=torch.int32):
    req_to_token = torch.zeros(len(lens) + 1, 1024, dtype=index)
    perm = torch.randperm(pool - 1, generator=gen) + 1
    used = 0
    for b, n in enumerate(lens):
        req_to_token[b + 1, :n] = perm[used : used + n].to(index)
        used += n
    k = torch.randn(pool, 2, 64, generator=gen)
    v = torch.randn(pool, 2, 64, generator=gen)
    return req_to_token, k, v


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_decode_row_does_not_depend_on_the_batch(ops, index) -> None:
    """Bit for bit: a request decoded alone and inside a batch (chunking is per request)."""
    gen = torch.Generator().manual_seed(2)
    lens = [300, 1, 65, 129]
    r2t, k, v = _pool(gen, lens, index=index)
    q = torch.randn(4, 8, 64, generator=gen)
    rpi = torch.arange(1, 5)

    def decode(rows: list[int]) -> torch.Tensor:
        out = torch.empty(len(rows), 8, 64)
        ops.decode_attention(
            q[rows], k, v, out, None, None, torch.zeros(len(rows), dtype=torch.int64), r2t,
            rpi[rows], torch.tensor([lens[i] for i in rows]), 0.125, 1.0, 1.0, 0.0, 0, None,
        )  # fmt: skip
        return out

    together = decode([0, 1, 2, 3])
    for i in range(4):
        assert torch.equal(decode([i]), together[i : i + 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(decode([0, 1, 2, 3]), together)  # nor on the thread count
    finally:
        torch.set_num_threads(threads)


def test_decode_writes_the_new_key_and_value_first(ops) -> None:
    gen = torch.Generator().manual_seed(3)
    r2t, k, v = _pool(gen, [10])
    new_k, new_v = torch.randn(1, 2, 64, generator=gen), torch.randn(1, 2, 64, generator=gen)
    loc = r2t[1, 9:10].long()
    q = torch.randn(1, 8, 64, generator=gen)
    out = torch.empty(1, 8, 64)
    ops.decode_attention(q, k, v, out, new_k, new_v, loc, r2t, torch.tensor([1]),
                         torch.tensor([10]), 0.125, 1.0, 1.0, 0.0, 0, None)  # fmt: skip
    assert torch.equal(k[loc], new_k) and torch.equal(v[loc], new_v)


def test_decode_writes_rows_through_a_strided_slot_column(ops) -> None:
    """A draft step's slots are one column of a [bs, steps] table (a strided view), which
    SGLang's eager runner hands over as is under ``SGLANG_EAGER_INPUT_NO_COPY``."""
    gen = torch.Generator().manual_seed(13)
    r2t, k, v = _pool(gen, [10, 12])
    table = torch.stack([r2t[1, 7:10], r2t[2, 9:12]]).long()  # [2 requests, 3 steps]
    loc = table[:, 2]
    assert not loc.is_contiguous()
    new_k, new_v = torch.randn(2, 2, 64, generator=gen), torch.randn(2, 2, 64, generator=gen)
    q, out = torch.randn(2, 8, 64, generator=gen), torch.empty(2, 8, 64)
    before = k[table[:, 1]].clone()
    ops.decode_attention(q, k, v, out, new_k, new_v, loc, r2t, torch.tensor([1, 2]),
                         torch.tensor([10, 12]), 0.125, 1.0, 1.0, 0.0, 0, None)  # fmt: skip
    assert torch.equal(k[loc], new_k) and torch.equal(v[loc], new_v)
    assert torch.equal(k[table[:, 1]], before)  # the neighbouring column is not written


@pytest.mark.parametrize(
    ("lens", "rpi", "message"),
    [
        ([5], [9], "request row out of range"),
        ([2000], [1], "seq_len out of range"),
        ([0], [1], "seq_len out of range"),
    ],
)
def test_decode_rejects_bad_indices(ops, lens, rpi, message) -> None:
    gen = torch.Generator().manual_seed(4)
    r2t, k, v = _pool(gen, [5])
    out = torch.empty(1, 8, 64)
    with pytest.raises(RuntimeError, match=message):
        ops.decode_attention(torch.randn(1, 8, 64), k, v, out, None, None, torch.zeros(1),
                             r2t, torch.tensor(rpi), torch.tensor(lens), 0.125, 1.0, 1.0, 0.0,
                             0, None)  # fmt: skip


def test_decode_rejects_pool_rows_outside_the_pool(ops) -> None:
    gen = torch.Generator().manual_seed(5)
    r2t, k, v = _pool(gen, [5])
    r2t[1, 3] = k.shape[0] + 7
    with pytest.raises(RuntimeError, match="KV row out of range"):
        ops.decode_attention(torch.randn(1, 8, 64), k, v, torch.empty(1, 8, 64), None, None,
                             torch.zeros(1), r2t, torch.tensor([1]), torch.tensor([5]), 0.125,
                             1.0, 1.0, 0.0, 0, None)  # fmt: skip


def test_extend_limit_routes_long_extends_to_pytorch(ops, monkeypatch) -> None:
    """Above ``NATIVE_MAX_EXTEND_TOKENS`` extend tokens the PyTorch path serves."""
    calls = []
    real = ops.extend_attention
    monkeypatch.setattr(native, "ops", lambda: type("Ops", (), {
        "extend_attention": staticmethod(lambda *a: calls.append(1) or real(*a)),
        "decode_attention": ops.decode_attention,
    })())  # fmt: skip
    gen = torch.Generator().manual_seed(6)
    for n in (
        attention_native.NATIVE_MAX_EXTEND_TOKENS,
        attention_native.NATIVE_MAX_EXTEND_TOKENS + 1,
    ):
        r2t, k, v = _pool(gen, [40 + n])
        q = torch.randn(n, 8, 64, generator=gen)
        out = torch.empty(n, 8, 64)
        attention.extend_attention(
            q, None, None, out, k, v, 1.0, 1.0, r2t, torch.tensor([1]), torch.tensor([40 + n]),
            torch.tensor([n]), torch.tensor([0]), n, 0.125, 0.0, False, 0, None, None, None, True,
        )  # fmt: skip
        assert torch.isfinite(out).all()
    assert calls == [1]


def test_extends_of_few_tokens_a_request_route_to_native(ops, monkeypatch) -> None:
    """Past ``NATIVE_MAX_EXTEND_TOKENS`` tokens an extend whose requests have few tokens each
    (a verify) still takes the native kernel, and matches the PyTorch path; one with a longer
    request takes PyTorch."""
    calls = []
    real = ops.extend_attention
    counting = type("Ops", (), {
        "extend_attention": staticmethod(lambda *a: calls.append(1) or real(*a)),
        "decode_attention": ops.decode_attention,
    })()  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    most = attention_native.NATIVE_MAX_ROWS_PER_REQUEST
    for bs, n, is_native in [(2, most, True), (2, most + 1, False), (9, 2, True)]:
        assert bs * n > attention_native.NATIVE_MAX_EXTEND_TOKENS
        lens = [30 + 3 * b + n for b in range(bs)]
        r2t, k, v = _pool(gen, lens)
        q = torch.randn(bs * n, 8, 64, generator=gen)
        args = (r2t, torch.arange(1, bs + 1), torch.tensor(lens), torch.full((bs,), n),
                torch.arange(bs) * n, n, 0.125, 0.0, False, 0, None, None, None, True)  # fmt: skip
        out, reference = torch.empty(bs * n, 8, 64), torch.empty(bs * n, 8, 64)
        calls.clear()
        monkeypatch.setattr(native, "ops", lambda: counting)
        attention.extend_attention(q, None, None, out, k, v, 1.0, 1.0, *args)
        assert calls == ([1] if is_native else [])
        monkeypatch.setattr(native, "ops", lambda: None)  # the PyTorch path
        attention.extend_attention(q, None, None, reference, k, v, 1.0, 1.0, *args)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_switch_and_key(monkeypatch, tmp_path) -> None:
    """``SGLSPEC_CPU_NATIVE=0`` means the PyTorch ops; the build is keyed by its source."""
    monkeypatch.setitem(native._state, "ops", "sentinel")
    assert native.ops() == "sentinel"  # loaded once per process
    monkeypatch.delitem(native._state, "ops")
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.ops() is None
    assert native.ensure_built() is None
    monkeypatch.delenv(native.ENV_SWITCH)
    path = native.library_path()
    edited = tmp_path / "linear.cpp"
    edited.write_text(native.SOURCES[-1].read_text() + "\n// edited\n")
    monkeypatch.setattr(native, "SOURCES", (*native.SOURCES[:-1], edited))
    assert native.library_path() != path
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "builds"))
    assert native.library_path().parent == tmp_path / "builds"


def test_store_cache_writes_strided_rows(ops) -> None:
    """What SGLang passes: K and V as views of the fused QKV output, rows by index."""
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(5, 3 * 128, generator=gen)
    _, k, v = qkv.split([128, 128, 128], dim=-1)
    k3, v3 = k.view(5, 2, 64), v.view(5, 2, 64)
    rows = torch.tensor([7, 0, 31, 8, 9], dtype=torch.int32)
    caches = [torch.zeros(32, 2, 64) for _ in range(4)]
    torch.ops.sgl_kernel.store_cache_cpu(k3, v3, caches[0], caches[1], rows, 128)
    caches[2].view(-1, 128)[rows.long()] = k
    caches[3].view(-1, 128)[rows.long()] = v
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="KV row out of range"):
        ops.store_rows(k, caches[0], torch.tensor([1, 2, 3, 4, 32]))


def test_silu_and_mul_rows_do_not_depend_on_each_other(ops) -> None:
    """Each row alone equals the same row inside a batch, bit for bit (a decode row and a
    verify row), and agrees with PyTorch's SiLU to float32 rounding; strided and 3-D inputs
    as SGLang passes them; other dtypes take the PyTorch path."""
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(9, 2 * 40 + 6, generator=gen) * 6
    x = wide[:, 3:83]  # rows with a stride, unit inner stride
    out = layers.silu_and_mul(x)
    for i in range(9):
        assert torch.equal(layers.silu_and_mul(x[i : i + 1]), out[i : i + 1])
    want = torch.nn.functional.silu(x[:, :40]) * x[:, 40:]
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(layers.silu_and_mul(x.reshape(3, 3, 80)), out.reshape(3, 3, 40))
    half = x.to(torch.bfloat16)
    assert layers.silu_and_mul(half).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_and_mul(half)


def _kv_layers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(12, 2, 3), (12, 2, 3), (12, 5), (12, 1, 4)]  # buffers of different row widths
    return [torch.randn(s, generator=gen) for s in shapes]


def _move(layers: list[torch.Tensor], tgt: torch.Tensor, src: torch.Tensor) -> None:
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t[0].numel() * t.element_size() for t in layers], dtype=torch.int64)
    kvcache.copy_all_layer_kv_cache(ptrs, strides, tgt, src)


@pytest.mark.parametrize(
    ("tgt", "src"),
    [([1, 2, 3], [2, 3, 7]), ([5, 6, 7, 8], [4, 5, 6, 7]), ([0], [11]), ([3, 9], [9, 3])],
)
def test_copy_kv_rows_matches_the_pytorch_move(ops, monkeypatch, tgt, src) -> None:
    """Overlapping and swapped moves read every source before writing: native and PyTorch
    versions leave identical buffers, each target holding its source's old row."""
    tgt_t, src_t = torch.tensor(tgt), torch.tensor(src, dtype=torch.int32)
    native_layers, torch_layers, before = _kv_layers(0), _kv_layers(0), _kv_layers(0)
    _move(native_layers, tgt_t, src_t)
    monkeypatch.setattr(kvcache.native, "ops", lambda: None)
    _move(torch_layers, tgt_t, src_t)
    untouched = [r for r in range(12) if r not in tgt]
    for got, want, old in zip(native_layers, torch_layers, before, strict=True):
        assert torch.equal(got, want)
        assert torch.equal(got[tgt_t], old[src_t.long()])
        assert torch.equal(got[untouched], old[untouched])


def test_copy_kv_rows_rejects_negative_locations(ops) -> None:
    layers = _kv_layers(1)
    with pytest.raises(RuntimeError, match="below 0"):
        _move(layers, torch.tensor([1, -1]), torch.tensor([2, 3]))
    with pytest.raises(RuntimeError, match="one source per target"):
        ops.copy_kv_rows(
            torch.tensor([layers[0].data_ptr()]),
            torch.tensor([24]),
            torch.tensor([1, 2]),
            torch.tensor([3]),
        )
