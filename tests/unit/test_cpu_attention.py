"""The fallback decode/extend attention ops against dense PyTorch attention.

Random paged layouts: every request's tokens live in shuffled pages of a shared pool, the last
page partially filled; GQA; logit cap; sliding window; draft-tree masks for target-verify.
"""

from __future__ import annotations

import math

import pytest
import sgl_kernel  # noqa: F401  (registers the fallback ops on this CPU host)
import torch
import torch.nn.functional as F

from sgl_spec.cpu_kernels import native
from tests.helpers.native_kernels import require_native

PAGE = 4
H, HKV, D = 4, 2, 16


@pytest.fixture(autouse=True, params=["native", "torch"])
def kernels(request, monkeypatch):
    """Each test on the native kernels (built for this host) and on the PyTorch ops."""
    if request.param == "torch":
        monkeypatch.setitem(native._state, "ops", None)
    else:
        require_native(monkeypatch)
    return request.param


def _paged_layout(seq_lens: list[int], gen: torch.Generator, pool_pages: int = 64):
    """req_to_token [bs, max_ctx] built from randomly permuted pages of size PAGE."""
    pages = torch.randperm(pool_pages, generator=gen)
    max_ctx = 64
    req_to_token = torch.zeros((len(seq_lens) + 2, max_ctx), dtype=torch.int32)
    next_page = 0
    for b, n in enumerate(seq_lens):
        for start in range(0, n, PAGE):
            page = int(pages[next_page])
            next_page += 1
            for j in range(start, min(start + PAGE, n)):
                req_to_token[b + 1, j] = page * PAGE + (j - start)
    req_pool_indices = torch.arange(1, len(seq_lens) + 1, dtype=torch.int64)
    return req_to_token, req_pool_indices


def _dense(q, k, v, mask, sm_scale, logit_cap=0.0):
    """q [n, H, D], k/v [m, HKV, D], mask [n, m] bool -> [n, H, D] (float64 reference)."""
    group = q.shape[1] // k.shape[1]
    kh = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vh = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(q.double().transpose(0, 1), kh.transpose(-1, -2)) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.matmul(F.softmax(s, dim=-1), vh).transpose(0, 1)


@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_matches_dense(logit_cap: float, window: int) -> None:
    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 6, 13, 9]
    bs = len(seq_lens)
    req_to_token, rpi = _paged_layout(seq_lens, gen)
    pool = 64 * PAGE
    k_cache = torch.randn(pool, HKV, D, generator=gen)
    v_cache = torch.randn(pool, HKV, D, generator=gen)
    q = torch.randn(bs, H, D, generator=gen)
    new_k = torch.randn(bs, HKV, D, generator=gen)
    new_v = torch.randn(bs, HKV, D, generator=gen)
    loc = torch.tensor([int(req_to_token[b + 1, n - 1]) for b, n in enumerate(seq_lens)])
    out = torch.empty(bs, H, D)
    logits = torch.empty(bs, H, 8, D + 1)
    sm_scale = 1 / math.sqrt(D)
    torch.ops.sgl_kernel.decode_attention_cpu(
        q,
        k_cache,
        v_cache,
        1.0,
        1.0,
        out,
        new_k,
        new_v,
        loc,
        logits,
        req_to_token,
        rpi,
        torch.tensor(seq_lens),
        sm_scale,
        logit_cap,
        False,
        window,
        None,
        None,
    )
    for b, n in enumerate(seq_lens):
        rows = req_to_token[b + 1, :n].long()
        assert torch.equal(k_cache[rows[-1]], new_k[b]), "new key not written at loc"
        mask = torch.ones(1, n, dtype=torch.bool)
        if window > 0:
            mask[0, : max(0, n - window)] = False
        ref = _dense(q[b : b + 1], k_cache[rows], v_cache[rows], mask, sm_scale, logit_cap)
        torch.testing.assert_close(out[b : b + 1].double(), ref, rtol=1e-5, atol=1e-5)


def _extend_case(gen, prefix_lens, ext_lens):
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens, strict=True)]
    req_to_token, rpi = _paged_layout(seq_lens, gen)
    pool = 64 * PAGE
    k_buf = torch.randn(pool, HKV, D, generator=gen)
    v_buf = torch.randn(pool, HKV, D, generator=gen)
    n_ext = sum(ext_lens)
    q = torch.randn(n_ext, H, D, generator=gen)
    k_ext = torch.randn(n_ext, HKV, D, generator=gen)
    v_ext = torch.randn(n_ext, HKV, D, generator=gen)
    starts = torch.tensor([0] + list(torch.tensor(ext_lens).cumsum(0)[:-1]))
    # the backend saves extend K/V into the pool before calling the op
    for b, (p, e) in enumerate(zip(prefix_lens, ext_lens, strict=True)):
        rows = req_to_token[b + 1, p : p + e].long()
        k_buf[rows] = k_ext[starts[b] : starts[b] + e]
        v_buf[rows] = v_ext[starts[b] : starts[b] + e]
    return seq_lens, req_to_token, rpi, k_buf, v_buf, q, k_ext, v_ext, starts


def _run_extend(case, ext_lens, *, tree_mask=None, window=0, logit_cap=0.0, pass_kv=True):
    seq_lens, req_to_token, rpi, k_buf, v_buf, q, k_ext, v_ext, starts = case
    out = torch.full_like(q, float("nan"))
    torch.ops.sgl_kernel.extend_attention_cpu(
        q,
        k_ext if pass_kv else None,
        v_ext if pass_kv else None,
        out,
        k_buf,
        v_buf,
        1.0,
        1.0,
        req_to_token,
        rpi,
        torch.tensor(seq_lens),
        torch.tensor(ext_lens, dtype=torch.int32),
        starts.to(torch.int32),
        max(ext_lens),
        1 / math.sqrt(D),
        logit_cap,
        False,
        window,
        None,
        None,
        tree_mask,
        True,
    )
    return out


@pytest.mark.parametrize("pass_kv", [True, False])
@pytest.mark.parametrize("window", [0, 4])
def test_extend_causal_matches_dense(pass_kv: bool, window: int) -> None:
    gen = torch.Generator().manual_seed(2)
    prefix_lens, ext_lens = [0, 5, 11], [7, 3, 1]
    case = _extend_case(gen, prefix_lens, ext_lens)
    out = _run_extend(case, ext_lens, window=window, logit_cap=3.0, pass_kv=pass_kv)
    seq_lens, req_to_token, _, k_buf, v_buf, q, _, _, starts = case
    for b, (p, e) in enumerate(zip(prefix_lens, ext_lens, strict=True)):
        n = p + e
        rows = req_to_token[b + 1, :n].long()
        qpos = torch.arange(p, n)[:, None]
        kpos = torch.arange(n)[None, :]
        mask = kpos <= qpos
        if window > 0:
            mask &= (qpos - kpos) < window
        ref = _dense(
            q[starts[b] : starts[b] + e], k_buf[rows], v_buf[rows], mask, 1 / math.sqrt(D), 3.0
        )
        torch.testing.assert_close(
            out[starts[b] : starts[b] + e].double(), ref, rtol=1e-5, atol=1e-5
        )


def test_extend_tree_mask_matches_dense() -> None:
    """Target-verify of a draft tree: each draft token sees the prefix and its ancestors only."""
    gen = torch.Generator().manual_seed(3)
    # tree over 5 draft tokens: 0 root; 1,2 children of 0; 3 child of 1; 4 child of 2
    parent = [-1, 0, 0, 1, 2]
    n = len(parent)
    tree = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parent[j]
    prefix_lens, ext_lens = [4, 9], [n, n]
    case = _extend_case(gen, prefix_lens, ext_lens)
    flat = torch.cat([tree.flatten(), tree.flatten()])
    out = _run_extend(case, ext_lens, tree_mask=flat)
    seq_lens, req_to_token, _, k_buf, v_buf, q, _, _, starts = case
    for b, p in enumerate(prefix_lens):
        rows = req_to_token[b + 1, : p + n].long()
        mask = torch.cat([torch.ones(n, p, dtype=torch.bool), tree], dim=1)
        ref = _dense(q[starts[b] : starts[b] + n], k_buf[rows], v_buf[rows], mask, 1 / math.sqrt(D))
        torch.testing.assert_close(
            out[starts[b] : starts[b] + n].double(), ref, rtol=1e-5, atol=1e-5
        )
    # and the tree mask really matters: the plain causal result differs for token 2
    causal = _run_extend(case, ext_lens)
    assert not torch.allclose(causal[2], out[2])


def test_decode_agrees_with_extend() -> None:
    """A token decoded alone and the same token inside an extend block agree up to float32
    rounding (the attention accumulates in float32; see ``attention``'s docstring)."""
    gen = torch.Generator().manual_seed(4)
    prefix_lens, ext_lens = [6, 10], [4, 4]
    case = _extend_case(gen, prefix_lens, ext_lens)
    ext_out = _run_extend(case, ext_lens)
    seq_lens, req_to_token, rpi, k_buf, v_buf, q, k_ext, v_ext, starts = case
    for i in range(4):
        idx = starts + i
        dec_out = torch.empty(2, H, D)
        torch.ops.sgl_kernel.decode_attention_cpu(
            q[idx],
            k_buf,
            v_buf,
            1.0,
            1.0,
            dec_out,
            None,
            None,
            torch.zeros(2, dtype=torch.int64),
            torch.empty(0),
            req_to_token,
            rpi,
            torch.tensor(prefix_lens) + i + 1,
            1 / math.sqrt(D),
            0.0,
            False,
            0,
            None,
            None,
        )
        torch.testing.assert_close(dec_out, ext_out[idx], rtol=2e-6, atol=2e-6)


def test_copy_all_layer_kv_cache_moves_rows_in_every_layer() -> None:
    layers = [torch.arange(40, dtype=torch.float32).view(10, 2, 2).clone() for _ in range(3)]
    before = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t[0].numel() * t.element_size() for t in layers], dtype=torch.int64)
    tgt = torch.tensor([1, 2, 3])
    src = torch.tensor([2, 3, 7])  # overlapping: row 2 is both read and written
    torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for t, b in zip(layers, before, strict=True):
        assert torch.equal(t[1], b[2]) and torch.equal(t[2], b[3]) and torch.equal(t[3], b[7])
        assert torch.equal(t[0], b[0]) and torch.equal(t[4:7], b[4:7])
