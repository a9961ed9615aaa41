"""Per-forward reuse in the CPU ops (``cpu_kernels.memo``): what the attention and rotary ops
derive from SGLang's index tensors is built once for all layers, and rebuilt whenever any of
those tensors is another object or changed in place (a stale plan would attend to the wrong
keys)."""

from __future__ import annotations

import threading

import torch

from sgl_spec.cpu_kernels import layers
from sgl_spec.cpu_kernels.attention import decode_attention, extend_attention
from sgl_spec.cpu_kernels.memo import LastCall
from tests.helpers.attention_reference import decode_attention_reference


def _counting(memo: LastCall, small, large, extra, builds: list[int]) -> int:
    def build() -> int:
        builds.append(1)
        return len(builds)

    return memo.get(small, large, extra, build)


def test_same_tensors_build_once_and_any_change_rebuilds() -> None:
    memo: LastCall[int] = LastCall()
    builds: list[int] = []
    lens, table = torch.tensor([5, 7]), torch.zeros(4, 8, dtype=torch.int32)
    assert _counting(memo, (lens,), (table,), (0,), builds) == 1
    assert _counting(memo, (lens,), (table,), (0,), builds) == 1  # every later layer
    lens += 1  # refilled in place (a static buffer)
    assert _counting(memo, (lens,), (table,), (0,), builds) == 2
    table[1, 3] = 9  # the request-to-token map written
    assert _counting(memo, (lens,), (table,), (0,), builds) == 3
    assert _counting(memo, (lens.clone(),), (table,), (0,), builds) == 4  # another object
    assert _counting(memo, (lens,), (table,), (1,), builds) == 5  # another flag
    assert _counting(memo, (lens, None), (table,), (1,), builds) == 6


def test_tensors_without_version_counter_are_compared_by_content() -> None:
    memo: LastCall[int] = LastCall()
    builds: list[int] = []
    with torch.inference_mode():
        table = torch.zeros(4, 8, dtype=torch.int32)
    lens = torch.tensor([3])
    assert _counting(memo, (lens,), (table,), (), builds) == 1
    assert _counting(memo, (lens,), (table,), (), builds) == 1
    with torch.inference_mode():
        table[0, 0] = 1
    assert _counting(memo, (lens,), (table,), (), builds) == 2


def test_entries_are_per_thread() -> None:
    memo: LastCall[int] = LastCall()
    builds: list[int] = []
    lens, table = torch.tensor([5]), torch.zeros(2, 2)
    _counting(memo, (lens,), (table,), (), builds)
    thread = threading.Thread(target=_counting, args=(memo, (lens,), (table,), (), builds))
    thread.start()
    thread.join()
    assert len(builds) == 2


def _decode_case(gen: torch.Generator):
    pool, heads, dim, length = 512, 4, 16, 40
    k_buf = torch.randn(pool, 2, dim, generator=gen)
    v_buf = torch.randn(pool, 2, dim, generator=gen)
    req_to_token = torch.zeros(3, 64, dtype=torch.int32)
    req_to_token[1, :length] = torch.randperm(pool, generator=gen)[:length].to(torch.int32)
    q = torch.randn(1, heads, dim, generator=gen)
    return k_buf, v_buf, req_to_token, q, torch.tensor([1]), torch.tensor([length])


def _decode(fn, k_buf, v_buf, req_to_token, q, rows, lens) -> torch.Tensor:
    out = torch.empty(q.shape)
    loc = torch.zeros(1, dtype=torch.int64)
    fn(q, k_buf, v_buf, 1.0, 1.0, out, None, None, loc, torch.empty(0), req_to_token, rows,
       lens, 0.25, 0.0, False, 0, None, None)  # fmt: skip
    return out


def test_decode_sees_a_rewritten_token_map_between_layers() -> None:
    """The same index tensor objects across calls (as across layers), with the map rewritten
    in place in between: the second call must read the new rows."""
    gen = torch.Generator().manual_seed(3)
    k_buf, v_buf, req_to_token, q, rows, lens = _decode_case(gen)
    _decode(decode_attention, k_buf, v_buf, req_to_token, q, rows, lens)
    req_to_token[1, :40] = torch.randperm(512, generator=gen)[:40].to(torch.int32)
    for _ in range(2):
        fast = _decode(decode_attention, k_buf, v_buf, req_to_token, q, rows, lens)
        ref = _decode(decode_attention_reference, k_buf, v_buf, req_to_token, q, rows, lens)
        torch.testing.assert_close(fast, ref, rtol=2e-5, atol=2e-5)
    lens[0] = 30  # a static seq_lens buffer refilled in place
    fast = _decode(decode_attention, k_buf, v_buf, req_to_token, q, rows, lens)
    ref = _decode(decode_attention_reference, k_buf, v_buf, req_to_token, q, rows, lens)
    torch.testing.assert_close(fast, ref, rtol=2e-5, atol=2e-5)


def test_extend_tree_mask_changed_in_place_is_seen() -> None:
    gen = torch.Generator().manual_seed(4)
    k_buf, v_buf, req_to_token, _, rows, _ = _decode_case(gen)
    q = torch.randn(3, 4, 16, generator=gen)
    lens, ext, starts = torch.tensor([40]), torch.tensor([3], dtype=torch.int32), torch.tensor([0])
    tree = torch.ones(3, 3, dtype=torch.bool).tril().flatten()

    def run() -> torch.Tensor:
        out = torch.empty(q.shape)
        extend_attention(q, None, None, out, k_buf, v_buf, 1.0, 1.0, req_to_token, rows, lens,
                         ext, starts, 3, 0.25, 0.0, False, 0, None, None, tree, True)  # fmt: skip
        return out

    chain = run()
    tree[7] = False  # query 2 no longer sees draft key 1
    siblings = run()
    assert torch.equal(chain[:2], siblings[:2])
    assert not torch.allclose(chain[2], siblings[2])


def test_rotary_fast_path_equals_the_general_rotation_bitwise() -> None:
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(128, 32, generator=gen)
    q, k = torch.randn(5, 4 * 32, generator=gen), torch.randn(5, 2 * 32, generator=gen)
    positions = torch.tensor([0, 9, 17, 100, 127])
    fast = layers.rotary_embedding(positions, q, k, 32, cache, True)
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    for x, y in zip((q, k), fast, strict=True):
        general = layers._rotate(x.view(5, -1, 32), cos[:, None], sin[:, None], True)
        assert torch.equal(general.reshape(x.shape), y)
    positions[1] = 10  # positions refilled in place: new cos/sin
    moved = layers.rotary_embedding(positions, q, k, 32, cache, True)
    assert not torch.equal(moved[0][1], fast[0][1])
    assert torch.equal(moved[0][0], fast[0][0])
