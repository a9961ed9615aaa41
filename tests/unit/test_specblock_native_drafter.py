"""The drafter's layer and heads in one native call each (``cpu_kernels/csrc/drafter.cpp``):
what they compute equals the PyTorch serving path (``fast_layer_forward``'s ops and the
modules' heads) to float32 rounding, keys written into the workspace included, and the trees a
step grows from them are the same trees."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.patches import cpu_packed_linear
from sgl_spec.specblock import fast_heads, fast_layer
from sgl_spec.specblock.drafting import DraftSettings, PrefixContext, grow_trees
from sgl_spec.specblock.tree import propose_from_logits
from sgl_spec.specblock.workspace import KVWorkspace
from tests.helpers.native_kernels import require_native
from tests.helpers.tiny_models import SPECBLOCK_D, SPECBLOCK_K, specblock_drafter

D, K = SPECBLOCK_D, SPECBLOCK_K
HEAD_DIM = 16  # the native layer's attention runs whole vectors of 16 floats
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def native_kernel(monkeypatch):
    require_native(monkeypatch)
    monkeypatch.setenv(cpu_packed_linear.ENV_SWITCH, "native")


def _drafter(seed: int = 0, layers: int = 2):
    model = specblock_drafter(seed, num_layers=layers, layer_overrides={"head_dim": HEAD_DIM})
    cpu_packed_linear.pack_linear_modules(model)
    return model


def _workspace(model, bs: int, columns: int, seed: int) -> KVWorkspace:
    attn = model.layers[0].self_attn
    n_kv = model.config.llama_config().num_key_value_heads
    ws = KVWorkspace.empty(
        len(model.layers), bs, columns, n_kv, attn.head_dim, torch.float32, "cpu", room=4
    )
    gen = torch.Generator().manual_seed(seed)
    for buffer in (*ws.keys, *ws.values):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return ws


def _pytorch_path(patch) -> None:
    patch.setattr(fast_layer, "_one_call", lambda *a: False)
    patch.setattr(fast_layer, "_fuse_call", lambda *a: False)
    patch.setattr(fast_heads, "_heads_state", lambda *a: None)


def _forward(model, ws, mask, native: bool, monkeypatch, from_draft: bool = True):
    """One forward (a tree round's from the drafter's own states, or an extend's from target
    features) with or without the native calls; the workspace keeps its visible length, the
    keys the forward wrote are returned."""
    gen = torch.Generator().manual_seed(7)
    bs, starts = ws.batch_size, 2
    cond = torch.randn(bs, starts, D if from_draft else 3 * D, generator=gen)
    ids = torch.randint(0, model.config.target_vocab_size, (bs, starts), generator=gen)
    positions = torch.tensor([[40, 41], [3, 900]])[:bs]
    with monkeypatch.context() as patch:
        if not native:
            _pytorch_path(patch)
        length = ws.length
        with torch.no_grad():
            out = model(
                cond,
                ids,
                from_draft=from_draft,
                positions=positions,
                context_kv=ws,
                attention_mask=mask,
                propose=4,
            )
        ws.length = length
    return out, [(k.clone(), v.clone()) for k, v in out.kv]


@pytest.mark.parametrize(
    "bs, shared_mask, from_draft", [(2, False, True), (1, True, True), (2, True, False)]
)
def test_native_layer_and_heads_equal_the_pytorch_path(
    native_kernel, monkeypatch, bs, shared_mask, from_draft
):
    """The layers, the first layer's input (a tree round's and an extend's, through the
    condition projection) and the heads."""
    model = _drafter()
    columns = 37  # the workspace grows behind them: 4 columns of room, 2 * K needed
    ws = _workspace(model, bs, columns, seed=1)
    calls, fused = [], []
    real = fast_layer.native_layer
    monkeypatch.setattr(fast_layer, "native_layer", lambda *a: calls.append(1) or real(*a))
    real_fuse = fast_layer._fuse_call
    monkeypatch.setattr(
        fast_layer, "_fuse_call", lambda *a: fused.append(real_fuse(*a)) or fused[-1]
    )
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(1 if shared_mask else bs, 2 * K, columns + 2 * K, generator=gen) < 0.6
    mask[..., columns:] = torch.tril(torch.ones(2 * K, 2 * K, dtype=torch.bool))
    fast, fast_kv = _forward(model, ws, mask, True, monkeypatch, from_draft)
    assert len(calls) == len(model.layers) and fast.proposal is not None and fused == [True]
    slow, slow_kv = _forward(model, ws, mask, False, monkeypatch, from_draft)
    assert slow.proposal is None
    torch.testing.assert_close(fast.hidden, slow.hidden, **TOL)
    torch.testing.assert_close(fast.logits, slow.logits, **TOL)
    torch.testing.assert_close(fast.rank_logits, slow.rank_logits, **TOL)
    for (k1, v1), (k2, v2) in zip(fast_kv, slow_kv, strict=True):
        torch.testing.assert_close(k1, k2, **TOL)
        torch.testing.assert_close(v1, v2, **TOL)
    want = propose_from_logits(slow.logits.flatten(0, 1), model.d2t, None, 4)
    assert torch.equal(fast.proposal.top_tokens, want.top_tokens)
    torch.testing.assert_close(fast.proposal.top_logprobs, want.top_logprobs, **TOL)


def test_native_layer_stands_aside_where_it_cannot_serve(native_kernel, monkeypatch) -> None:
    """A head size the kernel does not take (the tiny drafter's 8), or a context that is a
    per-layer list, runs the PyTorch ops."""
    calls = []
    real = fast_layer.native_layer
    monkeypatch.setattr(fast_layer, "native_layer", lambda *a: calls.append(1) or real(*a))
    narrow = specblock_drafter()
    assert narrow.layers[0].self_attn.head_dim % 16 != 0
    ws = _workspace(narrow, 1, 5, seed=3)
    with torch.no_grad():
        narrow(torch.randn(1, 1, D), torch.tensor([[1]]), from_draft=True, context_kv=ws)
        model = _drafter()
        kv = _workspace(model, 1, 5, seed=3).context(0)
        model(torch.randn(1, 1, D), torch.tensor([[1]]), from_draft=True, context_kv=[kv, kv])
    assert calls == []


def test_trees_grown_natively_are_the_pytorch_trees(native_kernel, monkeypatch) -> None:
    model = _drafter(seed=4, layers=1)
    settings = DraftSettings(num_blocks=2, max_nodes=12, max_starts=3)
    trees = []
    for native in (True, False):
        ws = _workspace(model, 2, 20, seed=5)
        prefix = PrefixContext(ws, torch.ones(2, 20, dtype=torch.bool))
        with monkeypatch.context() as patch:
            if not native:
                _pytorch_path(patch)
            root = torch.randn(2, D, generator=torch.Generator().manual_seed(6))
            result = grow_trees(model, prefix, root, [3, 9], torch.tensor([20, 20]), settings)
        trees.append([(t.tokens, t.parents) for t in result.trees])
    assert trees[0] == trees[1]
    assert any(len(tokens) > 1 for tokens, _ in trees[0])
