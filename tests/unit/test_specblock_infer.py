"""SPECBLOCK inference pieces without a server: drafting against the training layout, tree
packing and its greedy walk, the drafter KV pool, metrics and flags (paper Algorithm 2,
App. A.2, App. C)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sgl_spec.config import ConfigError, split_argv
from sgl_spec.cpu_kernels.tree_ops import verify_tree_greedy
from sgl_spec.models.registry import resolve_model_path
from sgl_spec.specblock.draft_kv import DrafterKVPool
from sgl_spec.specblock.drafting import DraftSettings, extend_prefix, grow_trees
from sgl_spec.specblock.stats import SpecBlockStats, offered_depth
from sgl_spec.specblock.training.trainer import chain_forward
from sgl_spec.specblock.workspace import KVWorkspace
from sgl_spec.verify.packing import (
    FULL_MASK,
    QLEN_ONLY,
    accepted_path,
    context_visibility,
    pack_trees,
)
from sgl_spec.verify.tree import DraftTree
from tests.helpers.references import build_verify_input, greedy_verify_walk
from tests.helpers.tiny_models import SPECBLOCK_D, SPECBLOCK_K, SPECBLOCK_V, specblock_drafter

torch.set_num_threads(1)
K, D, V = SPECBLOCK_K, SPECBLOCK_D, SPECBLOCK_V
B = torch.tensor


def _pool(model, rows: int = 64) -> DrafterKVPool:
    cfg = model.config.llama_config()
    return DrafterKVPool(
        model.config.num_layers,
        rows,
        K,
        cfg.num_key_value_heads,
        cfg.head_dim or D // cfg.num_attention_heads,
        torch.float32,
        "cpu",
    )


def _fill(model, pool, feats, toks, locs, chunks):
    """Drafter extend over positions ``0..n-1`` in the given chunks, as the worker runs it."""
    done, out = 0, None
    for size in chunks:
        prefix = pool.gather(locs[None, :done], B([done]), last_slot_only=False)
        pos = torch.arange(done, done + size)[None]
        out = extend_prefix(model, prefix, feats[:, pos[0]], toks[:, pos[0]], pos, B([size]))
        pool.write(locs[done : done + size], out.kv, torch.arange(size))
        done += size
    return out


def _inputs(t: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, t, 3 * D, generator=gen), torch.randint(0, V, (1, t), generator=gen)


@torch.no_grad()
def test_tree_rounds_equal_the_training_chain_layout():
    """The pooled extend + cut-1 root block + chain-end block reproduce ``chain_forward``
    (blocks 2 and 3 of a chain with cuts (1, K)): inference conditions the drafter exactly as
    training does."""
    model = specblock_drafter(rank_head=False)
    a, t = 6, 6 + 2 + 2 * K
    feats, toks = _inputs(t)
    pool = _pool(model)
    locs = torch.randperm(60)[: a + 1] + 2  # scattered pool rows, as SGLang's allocator gives
    ext = _fill(model, pool, feats, toks, locs, chunks=[4, a + 1 - 4])
    prefix = pool.gather(locs[None], B([a + 1]), last_slot_only=True)
    settings = DraftSettings(num_blocks=2, max_nodes=64, fixed_width=1)
    root = int(toks[0, a + 1])
    drafted = grow_trees(model, prefix, ext.root_cond, [root], B([a + 1]), settings)
    tree = drafted.trees[0]
    assert drafted.num_forwards == 2 and tree.num_nodes == 1 + 2 * K
    toks = toks.clone()
    toks[0, a + 1 + K] = tree.tokens[K]  # block 3 starts from the drafted chain end
    out = chain_forward(model, feats, toks, B([a]), B([[[1, K]]]))
    torch.testing.assert_close(drafted.round_logits[0][0, 0], out.logits[1][0, 0])
    torch.testing.assert_close(drafted.round_logits[1][0, 0], out.logits[2][0, 0])


@torch.no_grad()
def test_extend_in_chunks_equals_one_pass():
    model = specblock_drafter()
    feats, toks = _inputs(9, seed=5)
    locs = torch.arange(9) + 10
    one, two = _pool(model), _pool(model)
    a = _fill(model, one, feats, toks, locs, chunks=[9])
    b = _fill(model, two, feats, toks, locs, chunks=[2, 3, 4])
    torch.testing.assert_close(a.root_cond, b.root_cond)
    for x, y in zip(one.keys + one.values, two.keys + two.values, strict=True):
        torch.testing.assert_close(x, y)


@torch.no_grad()
def test_batched_drafting_equals_one_request_at_a_time():
    """Padding across requests (different context lengths and start counts) changes nothing."""
    model = specblock_drafter(seed=1)
    with torch.no_grad():  # a sharper rank head spreads the buckets
        model.rank_head.net[-1].bias.copy_(B([0.0, 2.0, 1.5, -1.0]))
    pool = _pool(model, rows=80)
    lens, roots, conds, locs = [5, 8, 3], [], [], []
    for i, n in enumerate(lens):
        feats, toks = _inputs(n + 1, seed=10 + i)
        loc = torch.arange(n) + 20 * i + 1
        conds.append(_fill(model, pool, feats, toks, loc, chunks=[n]).root_cond)
        roots.append(int(toks[0, n]))
        locs.append(loc)
    settings = DraftSettings(num_blocks=3, max_nodes=20, max_starts=3)
    width = max(lens)
    padded = torch.stack([torch.cat([x, x.new_zeros(width - x.numel())]) for x in locs])
    prefix = pool.gather(padded, B(lens), last_slot_only=True)
    batched = grow_trees(model, prefix, torch.cat(conds), roots, B(lens), settings)
    assert batched.num_forwards >= 2
    for i, n in enumerate(lens):
        alone = grow_trees(
            model,
            pool.gather(locs[i][None], B([n]), last_slot_only=True),
            conds[i],
            [roots[i]],
            B([n]),
            settings,
        )
        assert alone.trees[0].tokens == batched.trees[i].tokens
        assert alone.trees[0].parents == batched.trees[i].parents
        assert alone.trees[0].num_nodes <= settings.max_nodes


def _tree(tokens: list[int], parents: list[int]) -> DraftTree:
    tree = DraftTree.rooted_at(tokens[0])
    for tok, parent in zip(tokens[1:], parents[1:], strict=True):
        tree.add(tok, parent, -1.0)
    return tree


def test_pack_trees_constructed():
    a = _tree([7, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    b = _tree([9, 5], [-1, 0])
    packed = pack_trees([a, b], [10, 4], width=6)
    assert packed.draft_tokens.tolist() == [7, 1, 2, 3, 4, 0, 9, 5, 0, 0, 0, 0]
    assert packed.positions.tolist() == [10, 11, 11, 12, 12, 10, 4, 5, 4, 4, 4, 4]
    assert packed.retrieve_next_token.tolist() == [[1, 3, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1]]
    assert packed.retrieve_next_sibling.tolist() == [
        [-1, 2, -1, 4, -1, -1],
        [-1, -1, -1, -1, -1, -1],
    ]
    mask = packed.custom_mask.view(2, 6, 6)
    assert mask[0, 3].tolist() == [True, True, False, True, False, False]
    assert mask[0, 5].tolist() == [False] * 5 + [True]  # padding sees only itself
    assert mask[1, 1].tolist() == [True, True, False, False, False, False]
    full = pack_trees([a, b], [10, 4], width=6, mask_format=FULL_MASK).custom_mask
    assert full.numel() == 6 * (10 + 6) + 6 * (4 + 6)
    assert full[: 6 * 16].view(6, 16)[:, :10].all()
    assert torch.equal(full[: 6 * 16].view(6, 16)[:, 10:], mask[0])
    with pytest.raises(ValueError):
        pack_trees([a], [3], width=4)
    with pytest.raises(ValueError, match="precede"):  # node 1's parent comes after it
        pack_trees([DraftTree([7, 1, 2], [-1, 2, 0], [0, 2, 1], [0.0] * 3)], [3], width=4)
    assert packed.max_depth == 2 and packed.num_nodes == [5, 2]


def test_pack_trees_matches_the_per_tree_inputs():
    """The batch packing equals each tree's own verify input (``build_verify_input``,
    ``ancestor_mask``) padded to the width, for random trees up to 200 nodes (masks past 64
    bits) and both mask formats."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(12):
        trees, seq_lens = [], []
        width = [8, 33, 200][trial % 3]
        for _ in range(1 + trial % 4):
            n = int(torch.randint(1, width + 1, (1,), generator=gen))
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
            trees.append(
                _tree([int(x) for x in torch.randint(1, 50, (n,), generator=gen)], parents)
            )
            seq_lens.append(int(torch.randint(1, 20, (1,), generator=gen)))
        packed = pack_trees(trees, seq_lens, width)
        full = pack_trees(trees, seq_lens, width, mask_format=FULL_MASK).custom_mask
        mask, at = packed.custom_mask.view(len(trees), width, width), 0
        for b, (tree, seq_len) in enumerate(zip(trees, seq_lens, strict=True)):
            ref, n = build_verify_input(tree, seq_len), tree.num_nodes
            row = slice(b * width, b * width + n)
            assert torch.equal(packed.draft_tokens[row], ref.draft_tokens)
            assert torch.equal(packed.positions[row], ref.positions)
            assert torch.equal(packed.retrieve_next_token[b, :n], ref.retrieve_next_token)
            assert torch.equal(packed.retrieve_next_sibling[b, :n], ref.retrieve_next_sibling)
            expect = torch.eye(width, dtype=torch.bool)
            expect[:n, :n] = ref.tree_mask
            assert torch.equal(mask[b], expect)
            block = full[at : at + width * (seq_len + width)].view(width, seq_len + width)
            assert block[:, :seq_len].all() and torch.equal(block[:, seq_len:], expect)
            at += width * (seq_len + width)
        assert at == full.numel()


def test_packed_trees_verify_like_the_reference_walk():
    """SGLang's greedy tree verify on the packed arrays accepts the longest matching path."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = 1 + int(torch.randint(1, 12, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tokens = [int(x) for x in torch.randint(0, 4, (n,), generator=gen)]
        # siblings carry distinct tokens, as top-b candidates of one distribution do
        for i in range(1, n):
            while tokens[i] in [tokens[j] for j in range(1, i) if parents[j] == parents[i]]:
                tokens[i] += 4
        tree = _tree(tokens, parents)
        width = n + trial % 3
        packed = pack_trees([tree], [5], width)
        predict = torch.randint(0, 8, (1, width), generator=gen)
        predicts = torch.zeros(width, dtype=torch.int32)
        accept_index = torch.full((1, 13), -1, dtype=torch.int32)
        num = torch.zeros(1, dtype=torch.int32)
        verify_tree_greedy(
            predicts,
            accept_index,
            num,
            packed.draft_tokens.view(1, width),
            packed.retrieve_index,
            packed.retrieve_next_token,
            packed.retrieve_next_sibling,
            predict,
        )
        path, bonus = greedy_verify_walk(tokens, parents, predict[0, :n].tolist())
        assert accepted_path(accept_index, width) == [path]
        assert int(num) == len(path) - 1 and int(predicts[path[-1]]) == bonus


def test_context_visibility_and_pool_round_trip():
    vis = context_visibility(B([2, 3]), 3, 2, last_slot_only=True)
    assert vis.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert context_visibility(B([1]), 2, 2, last_slot_only=False).int().tolist() == [[1, 1, 0, 0]]
    model = specblock_drafter()
    pool = _pool(model, rows=8)
    n_kv, hd = pool.keys[0].shape[2:]
    kv = [(torch.randn(2, n_kv, 2 * K, hd), torch.randn(2, n_kv, 2 * K, hd)) for _ in pool.keys]
    pool.write(B([5, 1, 3]), kv, B([0, 1, 3]))  # (req 0, start 0), (0, 1), (1, 1)
    ctx = pool.gather(B([[5, 1], [3, 0]]), B([2, 1]), last_slot_only=False)
    key0 = ctx.kv.context(0)[0]  # [bs, n_kv, 2*K, hd]
    torch.testing.assert_close(key0[0], kv[0][0][0])
    torch.testing.assert_close(key0[1, :, :K], kv[0][0][1, :, K:])
    assert ctx.visible.int().tolist() == [[1] * 2 * K, [1] * K + [0] * K]
    # batch 1 gathers straight into the workspace: the same rows
    one = pool.gather(B([[3, 5]]), B([2]), last_slot_only=False)
    torch.testing.assert_close(one.kv.context(1)[1][0, :, K:], kv[1][1][0, :, :K])
    # the tree rounds' context, seen as the extend after the verify sees it: no second gather
    rounds = pool.gather(B([[5, 1], [3, 0]]), B([2, 1]), last_slot_only=True)
    again = pool.with_visibility(rounds, B([2, 1]), last_slot_only=False)
    assert torch.equal(again.visible, ctx.visible)
    assert again.kv is rounds.kv


def test_workspace_appends_behind_the_context_and_grows():
    n_kv, hd = 2, 4
    kv = [(torch.randn(1, n_kv, 3, hd), torch.randn(1, n_kv, 3, hd)) for _ in range(2)]
    ws = KVWorkspace.from_context(kv, room=2)
    new = torch.randn(1, n_kv, 5, hd)  # more than the room: the buffer grows, context kept
    for layer in range(2):
        key, value = ws.append(layer, new, new + 1)
        torch.testing.assert_close(key, torch.cat([kv[layer][0], new], dim=2))
        torch.testing.assert_close(value, torch.cat([kv[layer][1], new + 1], dim=2))
    assert ws.length == 3 and ws.capacity >= 8  # a forward's own keys do not move the length
    ws.length += 5
    torch.testing.assert_close(ws.context(1)[0], torch.cat([kv[1][0], new], dim=2))
    with pytest.raises(ValueError, match="batch"):
        ws.append(0, torch.randn(2, n_kv, 1, hd), torch.randn(2, n_kv, 1, hd))


def test_stats_alpha_and_summary():
    stats = SpecBlockStats(max_depth=3)
    parents = [-1, 0, 0, 1, 3]
    assert offered_depth(parents, [0, 1]) == 2  # node 1 has a child: depth 2 was offered
    assert offered_depth(parents, [0, 1, 3, 4]) == 3
    assert offered_depth([-1], [0]) == 0
    stats.record_step([1, 3, 0], [2, 3, 1], [5, 5, 3], 3, 0.01, 0.04)
    assert stats.alpha == [2 / 3, 1 / 2, 1.0]
    assert stats.accept_length == pytest.approx(1 + 4 / 3)
    line = stats.summary()
    assert "mean_accept_length=2.333" in line and "T_D%=25.0" in line
    assert "drafter_forwards_per_iter=3.00" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["--specblock-m", "0"],
        ["--specblock-k", "two"],
        ["--specblock-branching", "2,4,10"],
        ["--specblock-branching", "0,0,0,0"],
        ["--specblock-max-nodes", "1"],
    ],
)
def test_bad_specblock_flags_name_the_flag(argv):
    with pytest.raises(ConfigError, match=argv[0]):
        split_argv(argv)


def test_specblock_flags_parse():
    config, rest = split_argv(["--specblock-branching", "fallback", "--specblock-m", "3", "-x"])
    assert rest == ["-x"] and config.specblock_m == 3
    assert config.specblock_bucket_map == (2, 4, 6, 4)
    assert split_argv(["--specblock-branching", "1,2,3,0"])[0].specblock_bucket_map == (1, 2, 3, 0)
    assert QLEN_ONLY != FULL_MASK


def test_settings_and_target_fit_are_checked(tmp_path):
    from transformers import LlamaConfig

    from sgl_spec.config import SpecConfig
    from sgl_spec.specblock.settings import check_target_fit, load_settings

    model = specblock_drafter()
    model.save_pretrained(tmp_path / "d")
    settings = load_settings(SpecConfig(specblock_drafter_path=str(tmp_path / "d")))
    assert settings.block_size == K and settings.max_depth == 2 * K
    assert settings.draft.bucket_map == (2, 4, 10, 0) and settings.draft.max_nodes == 32
    with pytest.raises(ValueError, match="--specblock-k"):
        load_settings(SpecConfig(specblock_drafter_path=str(tmp_path / "d"), specblock_k=K + 1))
    with pytest.raises(ValueError, match="--specblock-drafter-path"):
        load_settings(SpecConfig(specblock_drafter_path=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="--specblock-drafter-path"):
        load_settings(SpecConfig())
    cfg = model.config  # aux layers (0, 1, 3) of a 4-layer target: 3 is the last layer
    target = LlamaConfig(hidden_size=D, vocab_size=V, num_hidden_layers=5)
    check_target_fit(cfg, target, "d")
    for bad in (
        LlamaConfig(hidden_size=D, vocab_size=V, num_hidden_layers=4),
        LlamaConfig(hidden_size=2 * D, vocab_size=V, num_hidden_layers=5),
        LlamaConfig(hidden_size=D, vocab_size=V + 1, num_hidden_layers=5),
    ):
        with pytest.raises(ValueError, match="does not fit the target"):
            check_target_fit(cfg, bad, "d")


def test_shipped_target_gets_the_shipped_drafter():
    from sgl_spec.algorithms import check_launch, with_shipped_defaults
    from sgl_spec.argv import LaunchArgs
    from sgl_spec.config import SpecConfig
    from sgl_spec.models.registry import DEFAULT_SPECBLOCK_DRAFTER, DEFAULT_TARGET
    from sgl_spec.specblock.flags import (
        SPECBLOCK_DEFAULT_M,
        SPECBLOCK_SHIPPED_MAX_NODES,
        SPECBLOCK_SHIPPED_NGRAM,
    )
    from sgl_spec.specblock.settings import load_settings

    def fill_specblock_defaults(config: SpecConfig, argv: list[str]) -> SpecConfig:
        return with_shipped_defaults(config, LaunchArgs.from_argv(argv))

    argv = ["--model-path", DEFAULT_TARGET, "--speculative-algorithm", "SPECBLOCK"]
    filled = fill_specblock_defaults(SpecConfig(), argv)
    assert filled.specblock_drafter_path == DEFAULT_SPECBLOCK_DRAFTER
    assert filled.specblock_max_nodes == SPECBLOCK_SHIPPED_MAX_NODES  # measured best here
    assert filled.specblock_m == SPECBLOCK_DEFAULT_M  # the generic default
    assert load_settings(filled).draft.max_nodes == SPECBLOCK_SHIPPED_MAX_NODES
    budget = fill_specblock_defaults(SpecConfig(specblock_max_nodes=24), argv)
    assert budget.specblock_max_nodes == 24  # user flags win
    # the n-gram branch: on by default there, not where it cannot combine, off when asked
    assert filled.specblock_ngram == SPECBLOCK_SHIPPED_NGRAM
    assert load_settings(filled).ngram == SPECBLOCK_SHIPPED_NGRAM
    for lone in (SpecConfig(specblock_adapt=True), SpecConfig(specblock_budget="off")):
        left = fill_specblock_defaults(lone, argv)
        left.validate()
        assert left.specblock_ngram is None and load_settings(left).ngram == 0
    assert fill_specblock_defaults(SpecConfig(specblock_ngram=0), argv).specblock_ngram == 0
    # the shipped drafter loads and fits the shipped target
    settings = load_settings(filled)
    assert settings.block_size > 1
    target = ["--model-path", resolve_model_path(DEFAULT_TARGET), *argv[2:]]
    check_launch(filled, LaunchArgs.from_argv(target))
    mine = fill_specblock_defaults(SpecConfig(specblock_drafter_path="/x", specblock_m=3), argv)
    assert (mine.specblock_drafter_path, mine.specblock_m) == ("/x", 3)
    other = ["--model-path", "/some/model", "--speculative-algorithm", "SPECBLOCK"]
    assert fill_specblock_defaults(SpecConfig(), other) == SpecConfig()
    standalone = [*argv[:2], "--speculative-algorithm", "STANDALONE"]
    assert fill_specblock_defaults(SpecConfig(), standalone) == SpecConfig()
    k1 = load_settings(SpecConfig(specblock_drafter_path="sgl-spec/tiny-code-specblock-k1"))
    assert k1.block_size == 1


@pytest.mark.parametrize("case", ["missing", "wrong_target"])
def test_launcher_refuses_bad_drafter_before_starting(tiny_models, tmp_path, case):
    drafter = tmp_path / "drafter"
    if case == "wrong_target":
        specblock_drafter().save_pretrained(drafter)  # hidden size 32, the target's is 64
    cmd = [
        sys.executable, "-m", "sgl_spec.launch_server",
        "--model-path", str(tiny_models["target"]),
        "--speculative-algorithm", "SPECBLOCK",
        "--specblock-drafter-path", str(drafter),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "error: --specblock-drafter-path" in proc.stderr, proc.stderr[-2000:]
    if case == "wrong_target":
        assert "does not fit the target" in proc.stderr


def test_kv_budget_counts_the_drafter_pool_bytes():
    from sgl_spec.specblock.draft_kv import drafter_kv_bytes_per_row, drafter_kv_shape

    config = specblock_drafter().config
    layers, k, heads, head_dim = drafter_kv_shape(config)
    pool = DrafterKVPool(layers, 10, k, heads, head_dim, torch.float16, "cpu")
    assert drafter_kv_bytes_per_row(config, torch.float16) * 10 == pool.nbytes()


@torch.no_grad()
def test_rank_head_off_grows_the_fixed_tree_of_a_drafter_without_one():
    """``--specblock-rank-head off``: the same trunk, trees as if the drafter had no rank head
    (``fixed_width`` siblings everywhere, later blocks from chain ends only)."""
    with_head = specblock_drafter(seed=2)
    with torch.no_grad():  # buckets that would widen and start blocks if they were used
        with_head.rank_head.net[-1].bias.copy_(B([0.0, 3.0, 2.0, -1.0]))
    without = specblock_drafter(seed=2, rank_head=False)
    without.load_state_dict(with_head.state_dict(), strict=False)
    feats, toks = _inputs(7, seed=4)
    locs = torch.arange(6) + 3
    trees = {}
    for name, model, use in (
        ("off", with_head, False),
        ("none", without, True),
        ("on", with_head, True),
    ):
        pool = _pool(model)
        ext = _fill(model, pool, feats, toks, locs, chunks=[6])
        prefix = pool.gather(locs[None], B([6]), last_slot_only=True)
        settings = DraftSettings(num_blocks=2, max_nodes=64, use_rank_head=use)
        trees[name] = grow_trees(model, prefix, ext.root_cond, [int(toks[0, 6])], B([6]), settings)
    off, none, on = (trees[n].trees[0] for n in ("off", "none", "on"))
    assert (off.tokens, off.parents) == (none.tokens, none.parents)
    assert off.num_nodes == 1 + 2 * 2 * K  # two blocks of K positions, 2 siblings each
    assert (on.tokens, on.parents) != (off.tokens, off.parents)
