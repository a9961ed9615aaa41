"""The speculative-decoding CPU ops (``spec_ops.py``, ``tree_ops.py``) against hand-computed
cases, loop ports of the upstream kernels, and tree properties; each op is also called through
``torch.ops.sgl_kernel`` and through the ``sgl_kernel`` Python wrapper SGLang imports."""

from __future__ import annotations

import enum

import pytest
import sgl_kernel  # the .pth hook registers our ops when the compiled library cannot load
import sgl_kernel.speculative
import torch

N_TREE = 4  # nodes in the hand-made trees: root + 3 drafts


class TreeMaskMode(enum.IntEnum):  # SGLang passes this IntEnum, not a plain int
    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


def _via_torch_ops(name: str):
    op = getattr(torch.ops.sgl_kernel, name)
    return lambda *args: op(*args)


def _via_wrapper(name: str):
    # SGLang imports these from ``sgl_kernel``; the n-gram path reaches the CPU op through
    # ``sgl_kernel.speculative.reconstruct_indices_from_tree_mask``, which dispatches on device
    if name == "reconstruct_indices_from_tree_mask_cpu":
        return sgl_kernel.speculative.reconstruct_indices_from_tree_mask
    return getattr(sgl_kernel, name)


CALLERS = pytest.mark.parametrize("call", [_via_torch_ops, _via_wrapper], ids=["ops", "wrapper"])


# ----------------------------------------------------------------------------------------------
# Draft trees: a tiny EAGLE draft loop (as in select_top_k_tokens / organize_draft_results)


def eagle_draft_tree(bs: int, topk: int, steps: int, num_draft: int, gen: torch.Generator):
    """(parent_list [bs, topk*(steps-1)+1], top_scores_index [bs, num_draft-1])."""
    probs = torch.rand(bs, topk, generator=gen).sort(-1, descending=True).values
    scores = probs
    score_list = [probs[:, None, :]]
    parents = [torch.arange(-1, topk).expand(bs, -1)]
    for i in range(1, steps):
        child = torch.rand(bs, topk, topk, generator=gen).sort(-1, descending=True).values
        expand = scores[:, :, None] * child  # [bs, topk, topk]
        scores, index = expand.flatten(1).topk(topk, dim=-1)
        score_list.append(expand)
        parents.append(index + topk * topk * (i - 1) + topk)
    flat_scores = torch.cat(score_list, dim=1).flatten(1)
    selected = flat_scores.topk(num_draft - 1, dim=-1).indices.sort(-1).values
    if steps > 1:
        parent_list = torch.cat(parents[:-1], dim=1)
    else:
        parent_list = torch.empty(bs, 0, dtype=torch.long)
    return parent_list, selected


def new_tree_outputs(bs: int, n: int, mask_numel: int, fill=True):
    mask = torch.full((mask_numel,), fill, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.long)
    links = torch.full((3, bs, n), -1, dtype=torch.long)
    return mask, positions, links


def build_tree(call, parent_list, selected, seq_lens, topk, depth, n, mode=TreeMaskMode.QLEN_ONLY):
    bs = seq_lens.numel()
    numel = bs * n * n + (int(seq_lens.sum()) * n if mode == TreeMaskMode.FULL_MASK else 0)
    mask, positions, (index, next_token, next_sibling) = new_tree_outputs(bs, n, numel)
    call("build_tree_kernel_efficient_cpu")(
        parent_list,
        selected,
        seq_lens,
        mask,
        positions,
        index,
        next_token,
        next_sibling,
        topk,
        depth,
        n,
        mode,
    )
    return mask, positions, index, next_token, next_sibling


def reference_build_tree(parent_list, selected, seq_lens, topk, depth, n):
    """Loop port of the upstream per-thread kernel (QLEN_ONLY mask), for valid trees."""
    bs = seq_lens.numel()
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    positions = torch.zeros(bs, n, dtype=torch.long)
    next_token = torch.full((bs, n), -1, dtype=torch.long)
    next_sibling = torch.full((bs, n), -1, dtype=torch.long)
    sel, plist = selected.tolist(), parent_list.tolist()
    for b in range(bs):
        for i in range(n - 1, 0, -1):  # thread 0: links
            parent_row, parent_pos = sel[b][i - 1] // topk, 0
            if parent_row > 0:
                parent_pos = sel[b].index(plist[b][parent_row]) + 1
            if next_token[b, parent_pos] != -1:
                next_sibling[b, i] = next_token[b, parent_pos]
            next_token[b, parent_pos] = i
        for tid in range(n):  # other threads: mask rows and positions
            mask[b, tid, 0] = True
            cur, pos = tid - 1, 0
            while tid > 0:
                pos += 1
                mask[b, tid, cur + 1] = True
                parent_row = sel[b][cur] // topk
                if parent_row == 0:
                    break
                cur = sel[b].index(plist[b][parent_row])
            positions[b, tid] = seq_lens[b] + pos
    index = torch.arange(bs * n).view(bs, n)
    return mask.view(-1), positions.view(-1), index, next_token, next_sibling


# ----------------------------------------------------------------------------------------------
# build_tree_kernel_efficient_cpu


@CALLERS
def test_build_tree_chain_topk1(call):
    # steps=3, topk=1: parents [-1, 0, 1], every draft token is the previous one's child
    parent_list, selected = torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]])
    seq_lens = torch.tensor([7])
    mask, positions, index, next_token, next_sibling = build_tree(
        call, parent_list, selected, seq_lens, 1, 3, N_TREE
    )
    assert torch.equal(mask.view(N_TREE, N_TREE), torch.ones(N_TREE, N_TREE).tril().bool())
    assert positions.tolist() == [7, 8, 9, 10]
    assert index.tolist() == [[0, 1, 2, 3]]
    assert next_token.tolist() == [[1, 2, 3, -1]]
    assert next_sibling.tolist() == [[-1, -1, -1, -1]]


@CALLERS
def test_build_tree_topk2(call):
    # steps=2, topk=2: flat scores [root children t0, t1 | t0's children 2,3 | t1's 4,5]
    # request 0 keeps {t0, t1, t0.c0}: root -> {1, 2}, 1 -> {3}
    # request 1 keeps {t1, t1.c0, t1.c1}: root -> {1}, 1 -> {2, 3}
    parent_list = torch.tensor([[-1, 0, 1], [-1, 0, 1]])
    selected = torch.tensor([[0, 1, 2], [1, 4, 5]])
    seq_lens = torch.tensor([5, 9])
    mask, positions, index, next_token, next_sibling = build_tree(
        call, parent_list, selected, seq_lens, 2, 2, N_TREE
    )
    rows = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    rows += [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    assert mask.view(-1, N_TREE).int().tolist() == rows
    assert positions.tolist() == [5, 6, 6, 7, 9, 10, 11, 11]
    assert index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert next_token.tolist() == [[1, 3, -1, -1], [1, 2, -1, -1]]
    assert next_sibling.tolist() == [[-1, 2, -1, -1], [-1, -1, 3, -1]]


@pytest.mark.parametrize("topk,steps,num_draft", [(1, 4, 5), (2, 3, 6), (4, 4, 8), (3, 1, 3)])
def test_build_tree_matches_kernel_port(topk, steps, num_draft):
    gen = torch.Generator().manual_seed(topk * 100 + steps)
    bs = 3
    parent_list, selected = eagle_draft_tree(bs, topk, steps, num_draft, gen)
    seq_lens = torch.randint(1, 50, (bs,), generator=gen)
    got = build_tree(_via_torch_ops, parent_list, selected, seq_lens, topk, steps, num_draft)
    want = reference_build_tree(parent_list, selected, seq_lens, topk, steps, num_draft)
    for name, g, w in zip(
        ["mask", "positions", "index", "next", "sibling"], got, want, strict=True
    ):
        assert torch.equal(g, w), name


def test_build_tree_properties():
    """Mask row = the node's root path; positions = seq_len + depth; links = the parent relation."""
    gen = torch.Generator().manual_seed(0)
    topk, steps, n, bs = 3, 4, 10, 4
    parent_list, selected = eagle_draft_tree(bs, topk, steps, n, gen)
    seq_lens = torch.randint(0, 30, (bs,), generator=gen)
    mask, positions, _, next_token, next_sibling = build_tree(
        _via_torch_ops, parent_list, selected, seq_lens, topk, steps, n
    )
    mask = mask.view(bs, n, n)
    for b in range(bs):
        parent = {}
        for i in range(1, n):  # node i -> parent node, straight from the draft bookkeeping
            row = int(selected[b, i - 1]) // topk
            parent[i] = 0 if row == 0 else selected[b].tolist().index(parent_list[b, row]) + 1
            assert parent[i] < i
        for i in range(n):
            path, node = {i}, i
            while node != 0:
                node = parent[node]
                path.add(node)
            assert {j for j in range(n) if mask[b, i, j]} == path
            assert positions[b * n + i] == seq_lens[b] + len(path) - 1
            children = sorted(j for j in parent if parent[j] == i)
            assert next_token[b, i] == (children[0] if children else -1)
        for i in range(1, n):
            siblings = sorted(j for j in parent if parent[j] == parent[i] and j > i)
            assert next_sibling[b, i] == (siblings[0] if siblings else -1)


def test_build_tree_full_mask_and_bitpacking():
    gen = torch.Generator().manual_seed(1)
    topk, steps, n, bs = 2, 3, 6, 2
    parent_list, selected = eagle_draft_tree(bs, topk, steps, n, gen)
    seq_lens = torch.tensor([3, 5])
    qlen = build_tree(_via_torch_ops, parent_list, selected, seq_lens, topk, steps, n)
    full = build_tree(
        _via_torch_ops, parent_list, selected, seq_lens, topk, steps, n, TreeMaskMode.FULL_MASK
    )
    offset = 0
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = full[0][offset : offset + n * (seq_len + n)].view(n, seq_len + n)
        assert rows[:, :seq_len].all()  # prefix columns are the caller's fill
        assert torch.equal(rows[:, seq_len:], qlen[0].view(bs, n, n)[b])
        offset += n * (seq_len + n)
    for got, want in zip(full[1:], qlen[1:], strict=True):
        assert torch.equal(got, want)
    packed = torch.zeros(bs * n, dtype=torch.uint8)
    _, positions, (index, next_token, next_sibling) = new_tree_outputs(bs, n, 0)
    torch.ops.sgl_kernel.build_tree_kernel_efficient_cpu(
        parent_list, selected, seq_lens, packed, positions, index, next_token, next_sibling,
        topk, steps, n, TreeMaskMode.QLEN_ONLY_BITPACKING,
    )  # fmt: skip
    bits = (packed.long()[:, None] >> torch.arange(n)) & 1
    assert torch.equal(bits.bool().view(-1), qlen[0])


# ----------------------------------------------------------------------------------------------
# verify_tree_greedy_cpu


def run_verify(call, candidates, index, next_token, next_sibling, target_predict, num_spec_step):
    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec_step), -1, dtype=torch.int32)
    accept_num = torch.full((bs,), -7, dtype=torch.int32)
    call("verify_tree_greedy_cpu")(
        predicts,
        accept_index,
        accept_num,
        candidates,
        index,
        next_token,
        next_sibling,
        target_predict,
    )
    return predicts, accept_index, accept_num


@CALLERS
def test_verify_topk2_tree_cases(call):
    # tree: root -> {1, 2}, 1 -> {3}; draft tokens 10, 11, 12 at nodes 1, 2, 3
    one = ([[0, 1, 2, 3]], [[1, 3, -1, -1]], [[-1, 2, -1, -1]])
    index, next_token, next_sibling = (torch.tensor(x * 4) for x in one)
    index += torch.arange(4)[:, None] * N_TREE
    candidates = torch.tensor([[99, 10, 11, 12]] * 4)
    target_predict = torch.tensor(
        [
            [10, 12, 50, 60],  # whole path 0-1-3 accepted, bonus 60 at node 3
            [11, 50, 61, 50],  # sibling 2 accepted, no child: bonus 61
            [10, 13, 50, 50],  # node 1 accepted, its child rejected: bonus 13
            [14, 50, 50, 50],  # everything rejected: bonus 14 at the root
        ]
    )
    predicts, accept_index, accept_num = run_verify(
        call, candidates, index, next_token, next_sibling, target_predict, 3
    )
    assert accept_num.tolist() == [2, 1, 1, 0]
    assert accept_index.tolist() == [[0, 1, 3], [4, 6, -1], [8, 9, -1], [12, -1, -1]]
    p = predicts.view(4, N_TREE).tolist()
    assert p == [[10, 12, -7, 60], [11, -7, 61, -7], [10, 13, -7, -7], [14, -7, -7, -7]]
    assert predicts.dtype == torch.int32 and accept_index.dtype == torch.int32


@CALLERS
def test_verify_chain_topk1(call):
    index = torch.tensor([[0, 1, 2, 3]])
    next_token, next_sibling = torch.tensor([[1, 2, 3, -1]]), torch.full((1, 4), -1)
    candidates = torch.tensor([[5, 6, 7, 8]])
    target_predict = torch.tensor([[6, 7, 9, 1]])  # accept 6, 7; reject 8; bonus 9
    predicts, accept_index, accept_num = run_verify(
        call, candidates, index, next_token, next_sibling, target_predict, 4
    )
    assert accept_num.tolist() == [2]
    assert accept_index.tolist() == [[0, 1, 2, -1]]
    assert predicts.tolist() == [6, 7, 9, -7]


def naive_greedy_walk(mask, candidates, target, n, max_accept):
    """Greedy acceptance from the mask alone: children of a node in index order."""
    parent = {i: max(j for j in range(i) if mask[i, j]) for i in range(1, n)}
    path = [0]
    while len(path) < max_accept:
        children = [c for c in range(1, n) if parent[c] == path[-1]]
        match = [c for c in children if candidates[c] == target[path[-1]]]
        if not match:
            break
        path.append(match[0])
    return path


def test_verify_matches_naive_walk_on_random_trees():
    gen = torch.Generator().manual_seed(2)
    for topk, steps, n in [(1, 5, 6), (2, 3, 6), (3, 4, 9), (4, 5, 16)]:
        bs = 6
        parent_list, selected = eagle_draft_tree(bs, topk, steps, n, gen)
        seq_lens = torch.randint(1, 20, (bs,), generator=gen)
        mask, _, index, next_token, next_sibling = build_tree(
            _via_torch_ops, parent_list, selected, seq_lens, topk, steps, n
        )
        vocab = 3  # small, so that paths of every length get accepted
        candidates = torch.randint(0, vocab, (bs, n), generator=gen)
        target_predict = torch.randint(0, vocab, (bs, n), generator=gen)
        predicts, accept_index, accept_num = run_verify(
            _via_torch_ops, candidates, index, next_token, next_sibling, target_predict, steps + 1
        )
        for b in range(bs):
            path = naive_greedy_walk(
                mask.view(bs, n, n)[b], candidates[b], target_predict[b], n, steps + 1
            )
            flat = [b * n + i for i in path]
            assert accept_num[b] == len(path) - 1
            assert accept_index[b].tolist() == flat + [-1] * (steps + 1 - len(flat))
            assert predicts[flat].tolist() == target_predict[b, path].tolist()
            untouched = sorted(set(range(b * n, (b + 1) * n)) - set(flat))
            assert (predicts[untouched] == -7).all()


# ----------------------------------------------------------------------------------------------
# reconstruct_indices_from_tree_mask_cpu


@CALLERS
def test_reconstruct_hand_case(call):
    # n-gram tree: 0 -> {1, 3}, 1 -> {2}, 3 -> {4}
    rows = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]
    mask = torch.tensor(rows, dtype=torch.bool).view(-1)
    positions = torch.empty(5, dtype=torch.long)
    index, next_token, next_sibling = torch.full((3, 1, 5), -5, dtype=torch.long)
    call("reconstruct_indices_from_tree_mask_cpu")(
        mask, torch.tensor([4]), positions, index, next_token, next_sibling, 1, 5
    )
    assert positions.tolist() == [4, 5, 6, 5, 6]
    assert index.tolist() == [[0, 1, 2, 3, 4]]
    assert next_token.tolist() == [[1, 2, -1, 4, -1]]
    assert next_sibling.tolist() == [[-1, 3, -1, -1, -1]]


def test_reconstruct_inverts_build_tree():
    gen = torch.Generator().manual_seed(3)
    topk, steps, n, bs = 3, 4, 10, 5
    parent_list, selected = eagle_draft_tree(bs, topk, steps, n, gen)
    seq_lens = torch.randint(0, 40, (bs,), generator=gen)
    mask, *built = build_tree(_via_torch_ops, parent_list, selected, seq_lens, topk, steps, n)
    positions = torch.empty(bs * n, dtype=torch.long)
    links = torch.full((3, bs, n), -5, dtype=torch.long)
    torch.ops.sgl_kernel.reconstruct_indices_from_tree_mask_cpu(
        mask, seq_lens, positions, *links, bs, n
    )
    for got, want in zip([positions, *links], built, strict=True):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------
# KV slot tables


def reference_segments(req_pool_indices, start, end):
    return [(int(r), int(s), int(e)) for r, s, e in zip(req_pool_indices, start, end, strict=True)]


@CALLERS
def test_assign_req_to_token_pool_and_extend_cache_locs(call):
    pool_len = 16
    req_to_token = torch.zeros(4, pool_len, dtype=torch.int32)
    req_pool_indices = torch.tensor([2, 0, 3])
    start, end = torch.tensor([3, 0, 5], dtype=torch.int32), torch.tensor([6, 2, 5])
    end = end.to(torch.int32)
    out_cache_loc = torch.tensor([100, 101, 102, 200, 201])
    call("assign_req_to_token_pool_cpu")(
        req_pool_indices, req_to_token, start, end, out_cache_loc, pool_len
    )
    want = torch.zeros(4, pool_len, dtype=torch.int32)
    want[2, 3:6] = torch.tensor([100, 101, 102])
    want[0, 0:2] = torch.tensor([200, 201])
    assert torch.equal(req_to_token, want)
    gathered = torch.full((5,), -1, dtype=torch.long)
    call("assign_extend_cache_locs_cpu")(
        req_pool_indices, req_to_token, start, end, gathered, pool_len
    )
    assert torch.equal(gathered, out_cache_loc)


def test_extend_cache_locs_matches_loop():
    gen = torch.Generator().manual_seed(4)
    pool_len, bs = 64, 6
    req_to_token = torch.randint(0, 10_000, (8, pool_len), generator=gen, dtype=torch.int32)
    req_pool_indices = torch.randperm(8, generator=gen)[:bs]
    start = torch.randint(0, 30, (bs,), generator=gen)
    end = start + torch.randint(0, 30, (bs,), generator=gen)
    want = [int(req_to_token[r, c]) for r, s, e in reference_segments(req_pool_indices, start, end)
            for c in range(s, e)]  # fmt: skip
    out = torch.full((len(want) + 3,), -1, dtype=torch.long)
    torch.ops.sgl_kernel.assign_extend_cache_locs_cpu(
        req_pool_indices, req_to_token, start, end, out, pool_len
    )
    assert out.tolist() == want + [-1, -1, -1]


@CALLERS
def test_draft_cache_locs_and_decode_metadata(call):
    # request 0 sits in pool row 1 with 3 committed tokens; topk=2, num_steps=2
    pool_len, topk, num_steps = 12, 2, 2
    req_to_token = torch.stack([torch.arange(12) + 100 * r for r in range(3)]).int()
    req_pool_indices, seq_lens = torch.tensor([1, 2]), torch.tensor([3, 5])
    out_cache_loc = torch.empty(2 * topk * num_steps, dtype=torch.long)
    call("assign_draft_cache_locs_contiguous_cpu")(
        req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
    )
    assert out_cache_loc.tolist() == [103, 104, 105, 106, 205, 206, 207, 208]
    table = call("build_draft_decode_metadata_cpu")(
        req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
    )
    assert table.shape == (4, pool_len) and table.dtype == torch.int32
    pad = [0] * 7
    assert table[0].tolist() == [100, 101, 102, 103, 104] + pad
    assert table[1].tolist() == [100, 101, 102, 105, 106] + pad
    assert table[2].tolist() == [200, 201, 202, 203, 204, 205, 206] + pad[:5]
    assert table[3].tolist() == [200, 201, 202, 203, 204, 207, 208] + pad[:5]


def test_decode_metadata_reads_what_draft_steps_write():
    """Draft step s of candidate k writes KV at out_cache_loc[b, k, s]; the expanded table row
    b*topk+k must list exactly prefix + those slots for seq_len + s + 1 entries."""
    gen = torch.Generator().manual_seed(5)
    pool_len, bs, topk, num_steps = 80, 3, 3, 4
    req_to_token = torch.randperm(8 * pool_len, generator=gen).int().view(8, pool_len)
    req_pool_indices = torch.tensor([5, 0, 7])
    seq_lens = torch.randint(1, 40, (bs,), generator=gen)
    out_cache_loc = torch.empty(bs * topk * num_steps, dtype=torch.long)
    torch.ops.sgl_kernel.assign_draft_cache_locs_contiguous_cpu(
        req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
    )
    table = torch.ops.sgl_kernel.build_draft_decode_metadata_cpu(
        req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
    )
    written = out_cache_loc.view(bs, topk, num_steps)
    seq_lens_expanded = seq_lens.repeat_interleave(topk)
    for step in range(num_steps):
        for row in range(bs * topk):
            b, k = divmod(row, topk)
            length = int(seq_lens_expanded[row]) + step + 1
            prefix = req_to_token[req_pool_indices[b], : seq_lens[b]].tolist()
            assert table[row, :length].tolist() == prefix + written[b, k, : step + 1].tolist()


# ----------------------------------------------------------------------------------------------
# Accepted tokens


@CALLERS
def test_fill_bonus_tokens(call):
    accept_tokens = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]], dtype=torch.int32)
    accept_lens = torch.tensor([3, 1, 2], dtype=torch.int32)
    bonus = torch.full((3,), -1, dtype=torch.int32)
    call("fill_bonus_tokens_cpu")(accept_tokens, accept_lens, bonus, 3)
    assert bonus.tolist() == [7, 8, 12]


@CALLERS
def test_fill_accept_out_cache_loc(call):
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 8]], dtype=torch.int32)
    out_cache_loc = torch.arange(9) + 50
    packed = torch.zeros(9, dtype=torch.long)
    call("fill_accept_out_cache_loc_cpu")(accept_index, out_cache_loc, packed)
    assert packed.tolist() == [50, 52, 54, 56, 57, 58, 0, 0, 0]


# ----------------------------------------------------------------------------------------------
# rotate_input_ids_cpu


def reference_rotate(ids, start, lens, new, select=None):
    ids = list(ids)
    for b, (s, n) in enumerate(zip(start, lens, strict=True)):
        ids[s : s + n - 1] = ids[s + 1 : s + n]
        if n > 0:
            ids[select[b] if select is not None else s + n - 1] = new[b]
    return ids


@CALLERS
def test_rotate_input_ids(call):
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    start, lens = torch.tensor([0, 3, 3], dtype=torch.int32), torch.tensor([3, 0, 4])
    call("rotate_input_ids_cpu")(ids, start, lens, torch.tensor([[90], [91], [92]]), None)
    assert ids.tolist() == [2, 3, 90, 5, 6, 7, 92]
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])  # each segment padded by one slot
    call("rotate_input_ids_cpu")(
        ids,
        torch.tensor([0, 4]),
        torch.tensor([3, 4]),
        torch.tensor([90, 91]),
        torch.tensor([3, 7]),
    )
    assert ids.tolist() == [2, 3, 3, 90, 6, 7, 0, 91]


def test_rotate_input_ids_matches_loop():
    gen = torch.Generator().manual_seed(6)
    lens = torch.randint(0, 7, (8,), generator=gen)
    start = torch.cumsum(lens, 0) - lens
    ids = torch.randint(0, 1000, (int(lens.sum()),), generator=gen)
    new = torch.randint(1000, 2000, (8,), generator=gen)
    want = reference_rotate(ids.tolist(), start.tolist(), lens.tolist(), new.tolist())
    torch.ops.sgl_kernel.rotate_input_ids_cpu(ids, start, lens, new, None)
    assert ids.tolist() == want


# ----------------------------------------------------------------------------------------------
# Schemas: every output is declared mutated, so functionalization and torch.compile see writes

MUTATED = {
    "verify_tree_greedy_cpu": {"predicts", "accept_index", "accept_token_num"},
    "build_tree_kernel_efficient_cpu": {
        "tree_mask",
        "positions",
        "retrive_index",
        "retrive_next_token",
        "retrive_next_sibling",
    },
    "reconstruct_indices_from_tree_mask_cpu": {
        "positions",
        "retrive_index",
        "retrive_next_token",
        "retrive_next_sibling",
    },
    "assign_req_to_token_pool_cpu": {"req_to_token"},
    "build_draft_decode_metadata_cpu": set(),
    "fill_bonus_tokens_cpu": {"bonus_tokens"},
    "fill_accept_out_cache_loc_cpu": {"accept_out_cache_loc"},
    "assign_draft_cache_locs_contiguous_cpu": {"out_cache_loc"},
    "assign_extend_cache_locs_cpu": {"out_cache_loc"},
    "rotate_input_ids_cpu": {"input_ids"},
}


@pytest.mark.parametrize("name", sorted(MUTATED))
def test_schema_marks_outputs_mutable(name):
    schema = getattr(torch.ops.sgl_kernel, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written == MUTATED[name]
