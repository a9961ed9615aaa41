"""``DrafterKVPool.gather`` on the CPU, in one native call and in PyTorch ops: a gather copies
per row only what the workspace does not hold already, and the context it returns holds the
pool's rows in every case (growth, rows written since, batch changes, the tree rounds' keys
written behind the context, growth past the workspace's layout)."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.specblock import draft_kv
from sgl_spec.specblock.draft_kv import GROWTH_COLUMNS, DrafterKVPool
from tests.helpers.native_kernels import require_native

LAYERS, ROWS, K, N_KV, HD = 2, 400, 4, 2, 8
B = torch.tensor
MARK = 1e9


@pytest.fixture(autouse=True, params=["native", "torch"])
def gather_path(request, monkeypatch):
    """Every test on both gathers: the native one (built for this host) and PyTorch's."""
    if request.param == "native":
        require_native(monkeypatch)
        assert draft_kv._native_ops() is not None
    else:
        monkeypatch.setattr(draft_kv, "_native_ops", lambda: None)
    return request.param


def _pool() -> DrafterKVPool:
    torch.manual_seed(0)
    pool = DrafterKVPool(LAYERS, ROWS, K, N_KV, HD, torch.float32, "cpu")
    for store in (*pool.keys, *pool.values):
        store.normal_()
    return pool


def _write(pool: DrafterKVPool, locs: list[int], seed: int) -> None:
    """New rows at ``locs`` through ``write`` (one request, one block per location)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(locs)
    kv = [
        tuple(torch.randn(1, N_KV, n * K, HD, generator=gen) for _ in range(2))
        for _ in range(LAYERS)
    ]
    pool.write(B(locs), kv, torch.arange(n))


def _gather(pool: DrafterKVPool, rows: list[list[int]]):
    width = max(len(r) for r in rows)
    locs = B([r + [0] * (width - len(r)) for r in rows])
    return pool.gather(locs, B([len(r) for r in rows]), last_slot_only=True), locs


def _assert_rows(
    pool: DrafterKVPool, ctx, locs: torch.Tensor, first: int = 0, row: int | None = None
) -> None:
    """Columns from position ``first`` on hold the pool's row at their location (padding:
    location 0), in every layer, in every row (or in ``row``)."""
    rows = slice(None) if row is None else slice(row, row + 1)
    locs = locs[rows]
    bs, t = locs.shape
    for layer in range(LAYERS):
        got = ctx.kv.context(layer)  # keys, values: [bs, n_kv, t*K, hd]
        for got_part, store in zip(got, (pool.keys[layer], pool.values[layer]), strict=True):
            got_part = got_part[rows]
            assert got_part.shape[2] == t * K
            want = store[locs[:, first:]].reshape(bs, (t - first) * K, N_KV, HD).transpose(1, 2)
            assert torch.equal(got_part[:, :, first * K :], want)


def _mark_prefix(ctx, positions: int) -> None:
    """Mark the first ``positions`` of every row: a gather that copies them again overwrites
    the mark."""
    for buffer in (*ctx.kv.keys, *ctx.kv.values):
        buffer[:, : positions * K] = MARK


def _marked(ctx, positions: int, row: int | None = None, first: int = 0) -> bool:
    """Whether positions ``first .. positions-1`` of every row (or of ``row``) hold the mark."""
    rows = slice(None) if row is None else slice(row, row + 1)
    return all(
        bool((b[rows, first * K : positions * K] == MARK).all())
        for b in (*ctx.kv.keys, *ctx.kv.values)
    )


def _append_behind(ctx, columns: int) -> None:
    """What a tree round does: its own keys written behind the visible context."""
    bs = ctx.kv.batch_size
    for layer in range(LAYERS):
        ctx.kv.append(
            layer, torch.full((bs, N_KV, columns, HD), -MARK), torch.zeros(bs, N_KV, columns, HD)
        )


def test_a_gather_for_the_same_requests_copies_only_what_is_new():
    pool = _pool()
    rows = [[5, 9, 13], [40, 41]]
    ctx, locs = _gather(pool, rows)
    _assert_rows(pool, ctx, locs)
    _mark_prefix(ctx, 2)  # both rows' first two positions, real in both
    _append_behind(ctx, 6)
    _write(pool, [60, 61], seed=1)
    _write(pool, [70, 71, 72], seed=2)
    rows = [rows[0] + [60, 61], rows[1] + [70, 71, 72]]
    ctx, locs = _gather(pool, rows)
    assert _marked(ctx, 2)  # taken from the workspace, not copied again
    _assert_rows(pool, ctx, locs, first=2)  # row 1's old padding and the new positions
    visible = ctx.visible.clone()
    pool.forget()
    assert torch.equal(_gather(pool, rows)[0].visible, visible)


def test_a_row_written_since_is_gathered_again_from_there():
    pool = _pool()
    rows = [[5, 9, 13], [40, 41]]
    ctx, _ = _gather(pool, rows)
    _mark_prefix(ctx, 2)
    _write(pool, [9], seed=3)  # a position the last gather read (a late catch-up, a reuse)
    ctx, locs = _gather(pool, [r + [80 + i] for i, r in enumerate(rows)])
    assert _marked(ctx, 1, row=0)  # before the rewritten position: kept
    assert not _marked(ctx, 2, row=0, first=1)  # the rewritten one: copied again
    _assert_rows(pool, ctx, locs, first=1, row=0)
    assert _marked(ctx, 2, row=1)  # the other request's context: kept
    _assert_rows(pool, ctx, locs, first=2)


def test_a_row_whose_request_changed_is_gathered_from_where_it_differs():
    pool = _pool()
    ctx, _ = _gather(pool, [[5, 9, 13], [40, 41, 42]])
    _mark_prefix(ctx, 3)
    # row 0: another request sharing the first two locations (a radix-cache hit); row 1: the
    # same request, retracted to one position and grown again
    ctx, locs = _gather(pool, [[5, 9, 77, 78], [40, 50]])
    assert _marked(ctx, 2, row=0) and not _marked(ctx, 3, row=0, first=2)
    assert _marked(ctx, 1, row=1) and not _marked(ctx, 2, row=1, first=1)
    _assert_rows(pool, ctx, locs, first=2, row=0)
    _assert_rows(pool, ctx, locs, first=1, row=1)


def test_every_change_of_batch_or_layout_gathers_what_the_pool_holds():
    pool = _pool()
    rows = [[1, 2, 3], [10, 11], [20]]
    ctx, locs = _gather(pool, rows)
    cases = [
        [[1, 2, 3, 4], [10, 11, 12], [20, 21]],  # growth
        [[1, 2, 3, 4, 5], [20, 21, 22]],  # a request left
        [[20, 21, 22, 23], [1, 2, 3, 4, 5, 6]],  # reordered
        [[20, 21, 22, 23], [1, 2, 3]],  # a row shorter than it was (retracted)
        [[20, 21, 22, 23], [1, 2, 3], [30]],  # a request joined
        [[20, 21, 22, 23], [1, 2, 3], [31]],  # same length, another location
        [[20, 21, 22, 23, 24], [1, 2, 3, 5], [31, 32]],  # growth
        [[1, 2, 3, 5, 6], [20, 21, 22, 23, 24, 25], [31, 32, 33]],  # two requests swap rows
    ]
    for step, rows in enumerate(cases):
        _append_behind(ctx, 5)
        _write(pool, [r[-1] for r in rows], seed=10 + step)
        ctx, locs = _gather(pool, rows)
        _assert_rows(pool, ctx, locs)
    # growth past the room the layout kept: a new layout, every position copied
    long_rows = [list(range(100, 100 + GROWTH_COLUMNS // K + 8)), [1, 2, 3]]
    ctx, locs = _gather(pool, long_rows)
    _assert_rows(pool, ctx, locs)
    pool.forget()
    ctx, locs = _gather(pool, long_rows)
    _assert_rows(pool, ctx, locs)


def test_steady_steps_equal_a_gather_from_scratch():
    """Steps of a decode: drafting's gather, the tree rounds behind it, the verify's writes."""
    pool = _pool()
    gen = torch.Generator().manual_seed(4)
    rows = [[int(x) for x in torch.randperm(ROWS, generator=gen)[:n]] for n in (7, 3, 12)]
    free = [x for x in range(ROWS) if all(x not in r for r in rows)]
    for step in range(12):
        ctx, locs = _gather(pool, rows)
        _assert_rows(pool, ctx, locs)
        _append_behind(ctx, 9)
        for i, row in enumerate(rows):
            accepted = [free.pop() for _ in range(1 + (step + i) % 4)]
            _write(pool, accepted, seed=100 * step + i)
            row.extend(accepted)


@pytest.mark.parametrize("layout", ["contiguous", "workspace"])
def test_write_stores_each_kept_block_at_its_location(layout):
    """``write`` of a forward's blocks (per layer [bs, n_kv, S*K, hd]: contiguous, or the
    transposed view of a workspace's rows a native layer leaves) keeps the listed ones."""
    pool = _pool()
    gen = torch.Generator().manual_seed(7)
    bs, s = 2, 3
    kv = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            if layout == "workspace":  # [bs, cap, n_kv, hd] rows, the forward's columns
                rows = torch.randn(bs, s * K + 5, N_KV, HD, generator=gen)
                pair.append(rows[:, 2 : 2 + s * K].transpose(1, 2))
            else:
                pair.append(torch.randn(bs, N_KV, s * K, HD, generator=gen))
        kv.append(tuple(pair))
    locs, keep = B([30, 31, 50, 33]), B([0, 2, 3, 5])  # request 0 starts 0, 2; request 1: 0, 2
    before = [t.clone() for t in (*pool.keys, *pool.values)]
    pool.write(locs, kv, keep)
    for layer, (key, value) in enumerate(kv):
        for new, store, old in ((key, pool.keys[layer], before[layer]),
                                (value, pool.values[layer], before[LAYERS + layer])):  # fmt: skip
            for loc, row in zip(locs.tolist(), keep.tolist(), strict=True):
                b, start = divmod(row, s)
                want = new[b, :, start * K : (start + 1) * K].transpose(0, 1)  # [K, n_kv, hd]
                assert torch.equal(store[loc], want)
            untouched = torch.ones(ROWS, dtype=torch.bool)
            untouched[locs] = False
            assert torch.equal(store[untouched], old[untouched])
    assert pool._written_at[locs].eq(pool._generation).all()
    assert pool._written_at[untouched].eq(0).all()


def test_with_visibility_is_the_packing_mask():
    from sgl_spec.verify.packing import context_visibility

    pool = _pool()
    ctx, _ = _gather(pool, [[5, 9, 13], [40, 41], [7]])
    for last_slot_only in (False, True):
        for counts in ([3, 2, 1], [2, 2, 0], [3, 0, 1]):
            seen = pool.with_visibility(ctx, B(counts), last_slot_only).visible
            assert torch.equal(seen, context_visibility(B(counts), 3, K, last_slot_only))


def test_a_failed_gather_leaves_nothing_taken_from_the_workspace():
    pool = _pool()
    rows = [[5, 9, 13], [40, 41]]
    ctx, _ = _gather(pool, rows)
    _mark_prefix(ctx, 2)  # what a gather that failed half-way might leave in the workspace
    with pytest.raises((IndexError, RuntimeError)):
        _gather(pool, [[5, 9, 13, 2 * ROWS], [40, 41, 42]])  # a location outside the pool
    ctx, locs = _gather(pool, [r + [60] for r in rows])
    _assert_rows(pool, ctx, locs)  # every position copied again
