"""The fast CPU attention path (``attention``) against the float64 reference
(``attention_reference``), and its decode/extend agreement.

A token decoded alone and the same token inside a verify block (causal chain or draft tree)
must get the same output up to float32 rounding (the fast path accumulates in float32, so the
last bits may depend on how many rows share a call, as they do in the linear layers); the
greedy-equality tests of every algorithm check what that means for served tokens. Shapes are random: grouped heads, contexts up to a
few hundred scattered pool rows, batches whose padding either stays cheap (one padded call)
or not (one request at a time).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from sgl_spec.cpu_kernels import attention_native, native, paged_kv
from sgl_spec.cpu_kernels.attention import decode_attention, extend_attention
from tests.helpers.attention_reference import (
    decode_attention_reference,
    extend_attention_reference,
)
from tests.helpers.native_kernels import require_native

POOL = 4096
MAX_CTX = 1024


@pytest.fixture(autouse=True, params=["native", "torch"])
def kernels(request, monkeypatch):
    """Each test on the native kernels (built for this host; every extend length) and on the
    PyTorch paths; tests that look inside the PyTorch paths take ``torch_only``."""
    if request.param == "torch" or "torch_only" in request.fixturenames:
        monkeypatch.setitem(native._state, "ops", None)
    else:
        require_native(monkeypatch)
        monkeypatch.setattr(attention_native, "NATIVE_MAX_EXTEND_TOKENS", 1 << 30)
    return request.param


@pytest.fixture
def torch_only(kernels):
    if kernels == "native":
        pytest.skip("looks inside the PyTorch paths")


@dataclass
class Case:
    """A verify-like extend batch over a paged pool; request ``b`` is pool row ``b + 1``."""

    req_to_token: torch.Tensor  # [rows, MAX_CTX]
    k_buf: torch.Tensor  # [POOL, Hkv, D]
    v_buf: torch.Tensor  # [POOL, Hkv, Dv]
    q: torch.Tensor  # [tokens, H, D]
    k_ext: torch.Tensor  # [tokens, Hkv, D]
    v_ext: torch.Tensor  # [tokens, Hkv, Dv]
    prefix: list[int]
    ext: list[int]
    masks: list[torch.Tensor]  # per request [e, e] bool: extend key j visible to query i

    @property
    def starts(self) -> list[int]:
        return [sum(self.ext[:b]) for b in range(len(self.ext))]


def make_case(
    gen: torch.Generator, heads: tuple[int, int], dims: tuple[int, int], prefix: list[int],
    ext: list[int], tree: bool, extra_rows: int = 0,
) -> Case:  # fmt: skip
    """Random K/V in shuffled pool rows; the extend K/V are saved in the pool too (as the
    backend does), and ``extra_rows`` spare request rows are left for decode layouts."""
    num_heads, num_kv_heads = heads
    dim, dim_v = dims
    # entries past a request's length are out of the pool: the ops must never read them
    req_to_token = torch.full((len(prefix) + 1 + extra_rows, MAX_CTX), POOL + 9, dtype=torch.int32)
    perm = (torch.randperm(POOL - 1, generator=gen) + 1).to(torch.int32)
    k_buf = torch.randn(POOL, num_kv_heads, dim, generator=gen)
    v_buf = torch.randn(POOL, num_kv_heads, dim_v, generator=gen)
    used, masks, ext_rows = 0, [], []
    for b, (p, e) in enumerate(zip(prefix, ext, strict=True)):
        req_to_token[b + 1, : p + e] = perm[used : used + p + e]
        used += p + e
        ext_rows.append(req_to_token[b + 1, p : p + e].long())
        masks.append(_tree(e, gen) if tree else torch.ones(e, e, dtype=torch.bool).tril())
    rows = torch.cat(ext_rows)
    q = torch.randn(sum(ext), num_heads, dim, generator=gen)
    return Case(req_to_token, k_buf, v_buf, q, k_buf[rows], v_buf[rows], prefix, ext, masks)


def _tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor mask (self included) of a random tree over ``n`` draft tokens, parents first."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def run_extend(fn, case: Case, *, tree: bool, pass_kv: bool = True, **kw) -> torch.Tensor:
    out = torch.full((case.q.shape[0], case.q.shape[1], case.v_buf.shape[2]), float("nan"))
    bs = len(case.prefix)
    fn(
        case.q,
        case.k_ext if pass_kv else None,
        case.v_ext if pass_kv else None,
        out,
        case.k_buf,
        case.v_buf,
        kw.get("key_scale", 1.0),
        kw.get("value_scale", 1.0),
        case.req_to_token,
        torch.arange(1, bs + 1),
        torch.tensor([p + e for p, e in zip(case.prefix, case.ext, strict=True)]),
        torch.tensor(case.ext, dtype=torch.int32),
        torch.tensor(case.starts, dtype=torch.int32),
        max(case.ext),
        case.q.shape[2] ** -0.5,
        kw.get("logit_cap", 0.0),
        False,
        kw.get("window", 0),
        None,
        kw.get("sinks"),
        torch.cat([m.flatten() for m in case.masks]) if tree else None,
        kw.get("is_causal", True),
    )
    return out


def run_decode(fn, case: Case, q: torch.Tensor, pool_rows: list[int], lens: list[int], **kw):
    """Decode of ``q`` [bs, H, D]; request ``i`` reads ``req_to_token[pool_rows[i]]``."""
    out = torch.full((q.shape[0], q.shape[1], case.v_buf.shape[2]), float("nan"))
    loc = torch.zeros(q.shape[0], dtype=torch.int64)
    fn(
        q,
        case.k_buf,
        case.v_buf,
        kw.get("key_scale", 1.0),
        kw.get("value_scale", 1.0),
        out,
        None,
        None,
        loc,
        torch.empty(0),
        case.req_to_token,
        torch.tensor(pool_rows, dtype=torch.int64),
        torch.tensor(lens, dtype=torch.int64),
        q.shape[2] ** -0.5,
        kw.get("logit_cap", 0.0),
        False,
        kw.get("window", 0),
        None,
        kw.get("sinks"),
    )
    return out


def _random_shape(seed: int) -> dict:
    rng = random.Random(seed)
    tree = rng.random() < 0.5
    n = rng.choice([1, 2, 4, 7, 16, 32])
    return {
        "heads": rng.choice([(8, 8), (4, 2), (8, 1), (6, 3)]),
        "dims": rng.choice([(64, 64), (16, 16), (128, 128), (32, 16)]),
        "bs": rng.choice([1, 2, 3] if n > 8 else [1, 2, 3, 8]),  # bs * n decode rows
        "n": n,
        "tree": tree,
        "logit_cap": rng.choice([0.0, 0.0, 30.0]),
        "sinks": rng.random() < 0.2,
        "window": 0 if tree else rng.choice([0, 0, 50]),
        "prefix": [rng.randint(0, 300) for _ in range(8)],
    }


@pytest.mark.parametrize("seed", range(24))
def test_decode_agrees_with_extend(seed: int) -> None:
    """Verify row (b, i) ~= decode of the same query over the keys it sees (prefix + its
    ancestors), in one batched decode of every row and in single-request decodes."""
    s = _random_shape(seed)
    gen = torch.Generator().manual_seed(seed)
    bs, n = s["bs"], s["n"]
    case = make_case(gen, s["heads"], s["dims"], s["prefix"][:bs], [n] * bs, s["tree"], bs * n)
    kw = {"logit_cap": s["logit_cap"], "window": s["window"]}
    if s["sinks"]:
        kw["sinks"] = torch.randn(s["heads"][0], generator=gen)
    verify = run_extend(extend_attention, case, tree=s["tree"], **kw)
    pool_rows, lens = [], []
    for b, p in enumerate(case.prefix):  # one decode request per verify row
        for i in range(n):
            keys = list(range(p)) + [p + j for j in range(n) if case.masks[b][i, j]]
            row = bs + 1 + len(lens)
            case.req_to_token[row, : len(keys)] = case.req_to_token[b + 1, keys]
            pool_rows.append(row)
            lens.append(len(keys))
    batched = run_decode(decode_attention, case, case.q, pool_rows, lens, **kw)
    torch.testing.assert_close(batched, verify, rtol=2e-6, atol=2e-6)
    for t in random.Random(seed).sample(range(bs * n), min(6, bs * n)):
        single = run_decode(decode_attention, case, case.q[t : t + 1], pool_rows[t:t + 1], lens[t:t + 1], **kw)  # fmt: skip
        torch.testing.assert_close(single, verify[t : t + 1], rtol=2e-6, atol=2e-6)


def test_extend_alone_agrees_with_extend_in_batch() -> None:
    """A request's verify output does not depend on the other requests of the batch (up to
    float32 rounding: padding to the batch's longest request changes the reduction length)."""
    gen = torch.Generator().manual_seed(7)
    case = make_case(gen, (4, 2), (64, 64), [40, 290, 3, 128], [4] * 4, tree=True)
    together = run_extend(extend_attention, case, tree=True)
    for b in range(4):
        alone = Case(
            case.req_to_token[[0, b + 1]], case.k_buf, case.v_buf,
            case.q[4 * b : 4 * b + 4], case.k_ext[4 * b : 4 * b + 4],
            case.v_ext[4 * b : 4 * b + 4], [case.prefix[b]], [4], [case.masks[b]],
        )  # fmt: skip
        torch.testing.assert_close(
            run_extend(extend_attention, alone, tree=True),
            together[4 * b : 4 * b + 4],
            rtol=2e-6,
            atol=2e-6,
        )


EXTEND_CASES = {
    "causal gqa": ({"heads": (8, 2)}, {}),
    "tree": ({"tree": True}, {}),
    "tree ragged prefix": ({"tree": True, "prefix": [0, 200, 7]}, {}),
    "window": ({}, {"window": 9}),
    "logit cap": ({}, {"logit_cap": 2.0}),
    "sinks": ({"heads": (6, 3)}, {"sinks": True}),
    "kv from pool": ({}, {"pass_kv": False}),
    "kv passed, pool stale": ({"prefix": [3, 40], "ext": [5, 2]}, {"stale_pool": True}),
    "scales": ({"dims": (32, 16)}, {"key_scale": 0.5, "value_scale": 2.0}),
    # the native kernel's 8 x 8 key tiles and 8-wide value blocks leave remainders here
    "head dims off the tiles": ({"heads": (3, 1), "dims": (20, 12), "tree": True}, {}),
    "not causal": ({}, {"is_causal": False}),
    "ragged, padded": ({"prefix": [50, 60, 40], "ext": [5, 3, 4]}, {}),
    "a request without new tokens": ({"prefix": [50, 60, 40], "ext": [3, 0, 4]}, {}),
    "ragged, per request": ({"prefix": [0, 600, 2], "ext": [300, 1, 3]}, {"window": 30}),
    "ragged tree, per request": ({"tree": True, "prefix": [5, 9], "ext": [3, 6]}, {}),
}


@pytest.mark.parametrize("name", list(EXTEND_CASES))
def test_extend_matches_reference(name: str) -> None:
    shape, kw = EXTEND_CASES[name]
    kw = dict(kw)  # the case table is shared by every parametrization
    gen = torch.Generator().manual_seed(11)
    prefix = shape.get("prefix", [17, 250, 64])
    ext = shape.get("ext", [6] * len(prefix))
    tree = shape.get("tree", False)
    case = make_case(gen, shape.get("heads", (4, 4)), shape.get("dims", (64, 64)), prefix, ext, tree)  # fmt: skip
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(case.q.shape[1], generator=gen)
    if kw.pop("stale_pool", False):  # the passed extend K/V must win over the pool's rows
        for b, (p, e) in enumerate(zip(prefix, ext, strict=True)):
            rows = case.req_to_token[b + 1, p : p + e].long()
            case.k_buf[rows] = torch.randn(e, *case.k_buf.shape[1:], generator=gen)
            case.v_buf[rows] = torch.randn(e, *case.v_buf.shape[1:], generator=gen)
    fast = run_extend(extend_attention, case, tree=tree, **kw)
    ref = run_extend(extend_attention_reference, case, tree=tree, **kw)
    torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("lens", "kw"),
    [
        ([257], {}),
        ([257, 257, 257], {"logit_cap": 3.0}),
        ([100, 120, 90, 130], {"window": 40}),
        ([5, 600, 20], {"sinks": True}),
        ([1, 2, 300], {"key_scale": 0.25, "value_scale": 3.0}),
    ],
)
@pytest.mark.parametrize("per_request", [False, True])
def test_decode_matches_reference(
    lens: list[int], kw: dict, per_request: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if per_request:  # as for a batch too ragged to pad
        monkeypatch.setattr(paged_kv, "SMALL_PAIRS", 0)
        monkeypatch.setattr(paged_kv, "MAX_PAD", 1.0)
    gen = torch.Generator().manual_seed(12)
    case = make_case(gen, (8, 2), (64, 64), [n - 1 for n in lens], [1] * len(lens), tree=False)
    if kw.pop("sinks", False):
        kw = {**kw, "sinks": torch.randn(8, generator=gen)}
    rows = list(range(1, len(lens) + 1))
    fast = run_decode(decode_attention, case, case.q, rows, lens, **kw)
    ref = run_decode(decode_attention_reference, case, case.q, rows, lens, **kw)
    torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)


def test_empty_batches_are_no_ops() -> None:
    """bs 0 (decode and extend) and an extend call without tokens compute nothing."""
    gen = torch.Generator().manual_seed(13)
    case = make_case(gen, (4, 2), (16, 16), [3], [2], tree=False)
    assert run_decode(decode_attention, case, case.q[:0], [], []).shape == (0, 4, 16)
    for bs in (0, 1):
        lens = torch.full((bs,), 3)  # request row 1 of req_to_token, no new token
        extend_attention(
            case.q[:0], None, None, case.q[:0], case.k_buf, case.v_buf, 1.0, 1.0,
            case.req_to_token, lens // 3, lens, lens * 0, lens * 0, 0, 0.25, 0.0, False, 0,
            None, None, None, True,
        )  # fmt: skip


@pytest.mark.parametrize("saved", [True, False])
def test_lone_request_in_consecutive_pool_rows_is_read_in_place(
    monkeypatch, saved: bool, torch_only
) -> None:
    """One request whose keys sit in consecutive pool rows: decode and extend read the pool
    in place (no gather) and agree with the gathering path; extend K/V that the pool does not
    hold (``saved=False``) are used as given, never replaced by the pool's rows."""
    gen = torch.Generator().manual_seed(7)
    case = make_case(gen, (8, 2), (16, 16), [40], [5], tree=True, extra_rows=1)
    first, total = 1000, 45
    case.req_to_token[1, :total] = torch.arange(first, first + total, dtype=torch.int32)
    ext_rows = torch.arange(first + 40, first + total)
    if saved:
        case.k_ext, case.v_ext = case.k_buf[ext_rows], case.v_buf[ext_rows]
    else:
        case.k_ext = torch.randn(case.k_ext.shape, generator=gen)
    case.req_to_token[2, :total] = case.req_to_token[1, :total]
    views = []
    original = paged_kv.pool_view

    def counting(*args):
        view = original(*args)
        views.append(view is not None)
        return view

    monkeypatch.setattr(paged_kv, "pool_view", counting)
    in_place = run_extend(extend_attention, case, tree=True)
    decoded = run_decode(decode_attention, case, case.q[:1], [2], [total])
    assert views == [saved, saved, True, True]
    monkeypatch.setattr(paged_kv, "POOL_VIEW", False)
    gathered = run_extend(extend_attention, case, tree=True)
    torch.testing.assert_close(in_place, gathered, rtol=2e-6, atol=2e-6)
    reference = run_extend(extend_attention_reference, case, tree=True)
    torch.testing.assert_close(in_place, reference, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(
        decoded, run_decode(decode_attention, case, case.q[:1], [2], [total])
    )
