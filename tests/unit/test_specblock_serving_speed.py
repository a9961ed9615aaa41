"""The drafter's serving shortcuts on the CPU: a rotary table read instead of recomputed, and
linear layers through the target's packed kernel; both leave what the drafter computes as it was
(the table bit for bit, the kernel to float32 rounding) and keep training's autograd path."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.patches import cpu_packed_linear
from tests.helpers.native_kernels import require_native
from tests.helpers.tiny_models import SPECBLOCK_D, SPECBLOCK_K, SPECBLOCK_V, specblock_drafter

D, K, V = SPECBLOCK_D, SPECBLOCK_K, SPECBLOCK_V


@pytest.mark.parametrize(
    "positions",
    [[[0, 1, 2, 3]], [[1000, 3, 77, 255, 256, 5000]], [[7, 7, 9], [300, 2, 1]]],
)
def test_rotary_table_rows_equal_the_module(positions) -> None:
    model = specblock_drafter().eval()
    pos = torch.tensor(positions)
    x = torch.zeros(*pos.shape, D)
    with torch.no_grad():
        want = model.rotary(x, pos)
        got = model.rotary_embedding(x, pos)
        again = model.rotary_embedding(x, pos)  # from the table built by the first call
    for a, b, c in zip(want, got, again, strict=True):
        assert a.shape == b.shape and torch.equal(a, b) and torch.equal(a, c)
    assert model._rope_table[1].shape[1] > int(pos.max())


def test_rotary_with_autograd_uses_the_module() -> None:
    model = specblock_drafter()
    x = torch.zeros(1, 3, D)
    model.rotary_embedding(x, torch.tensor([[0, 1, 2]]))
    assert getattr(model, "_rope_table", None) is None


@pytest.fixture
def native_kernel(monkeypatch):
    require_native()
    monkeypatch.setenv(cpu_packed_linear.ENV_SWITCH, "native")


def _run(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    cond, ids = torch.randn(2, 3, 3 * D, generator=gen), torch.randint(0, V, (2, 3), generator=gen)
    with torch.no_grad():
        out = model(cond, ids)
    return torch.cat([out.logits.flatten(), out.hidden.flatten()])


def test_packed_drafter_matches_the_plain_one(native_kernel) -> None:
    plain, packed = specblock_drafter().eval(), specblock_drafter().eval()
    count = cpu_packed_linear.pack_linear_modules(packed)
    linears = [m for m in packed.modules() if type(m) is torch.nn.Linear]
    assert count == len(linears) > 0
    assert all(hasattr(m, "_sgl_spec_packed") for m in linears)
    torch.testing.assert_close(_run(packed), _run(plain), rtol=1e-5, atol=1e-5)
    # an in-place weight update (serving-time adaptation) is packed again before its next use
    with torch.no_grad():
        for model in (plain, packed):
            model.lm_head.weight.mul_(-2.0)
    torch.testing.assert_close(_run(packed), _run(plain), rtol=1e-5, atol=1e-5)


def test_packed_layer_keeps_autograd(native_kernel) -> None:
    layer = torch.nn.Linear(8, 5)
    reference = torch.nn.Linear(8, 5)
    reference.load_state_dict(layer.state_dict())
    assert cpu_packed_linear.pack_linear_modules(layer) == 1
    x = torch.randn(4, 8)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


def test_nothing_is_packed_when_the_kernel_is_off(monkeypatch) -> None:
    monkeypatch.setenv(cpu_packed_linear.ENV_SWITCH, "0")
    model = specblock_drafter()
    assert cpu_packed_linear.pack_linear_modules(model) == 0
    assert not any(hasattr(m, "_sgl_spec_packed") for m in model.modules())
    assert cpu_packed_linear.pack_linear_modules(model.to(torch.bfloat16), "native") == 0


def _context_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    cond = torch.randn(2, 3, 3 * D, generator=gen)
    ids = torch.randint(0, V, (2, 3), generator=gen)
    positions = torch.tensor([[5, 9, 40], [0, 1, 2]])
    return cond, ids, positions


def test_fast_layers_match_the_transformers_layers(native_kernel, monkeypatch) -> None:
    """The native decoder-layer path (no autograd, float32 CPU) computes what transformers'
    layers compute, with a cached context and a mask that hides part of it, and follows an
    in-place weight update of a fused projection."""
    from sgl_spec.specblock import fast_layer
    from sgl_spec.specblock import model as model_module

    model = specblock_drafter().eval()
    cond, ids, positions = _context_inputs(5)
    with torch.no_grad():
        context = model(cond, ids, positions=positions + 50).kv
        mask = torch.rand(2, 3 * K, 3 * K + 3 * K, generator=torch.Generator().manual_seed(1)) < 0.7
        mask[..., 3 * K :] = True  # own block visible; part of the context hidden
        calls = []
        real = fast_layer.fast_layer_forward
        monkeypatch.setattr(
            model_module, "fast_layer_forward", lambda *a: calls.append(1) or real(*a)
        )
        fast = model(cond, ids, positions=positions, context_kv=context, attention_mask=mask)
        assert len(calls) == len(model.layers)
        monkeypatch.setattr(model_module, "fast_path_ok", lambda *a: False)
        slow = model(cond, ids, positions=positions, context_kv=context, attention_mask=mask)
        for a, b in ((fast.hidden, slow.hidden), (fast.logits, slow.logits)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for (k1, v1), (k2, v2) in zip(fast.kv, slow.kv, strict=True):
            torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)
        model.layers[0].self_attn.k_proj.weight.mul_(0.5)
        changed_slow = model(
            cond, ids, positions=positions, context_kv=context, attention_mask=mask
        )
        monkeypatch.setattr(model_module, "fast_path_ok", fast_layer.fast_path_ok)
        changed_fast = model(
            cond, ids, positions=positions, context_kv=context, attention_mask=mask
        )
    torch.testing.assert_close(changed_fast.hidden, changed_slow.hidden, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed_fast.hidden, fast.hidden)
    # a parameter replaced on its module (not updated in place) is packed afresh too
    attn = model.layers[0].self_attn
    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach() * 2.0)
    model.fuse.weight = torch.nn.Parameter(model.fuse.weight.detach() * 0.5)
    with torch.no_grad():
        replaced_fast = model(
            cond, ids, positions=positions, context_kv=context, attention_mask=mask
        )
        monkeypatch.setattr(model_module, "fast_path_ok", lambda *a: False)
        monkeypatch.setattr(model_module, "serving_on_cpu", lambda *a: False)
        replaced_slow = model(
            cond, ids, positions=positions, context_kv=context, attention_mask=mask
        )
    torch.testing.assert_close(replaced_fast.hidden, replaced_slow.hidden, rtol=1e-5, atol=1e-5)


def test_fast_layers_stand_aside_for_training_and_other_dtypes(native_kernel) -> None:
    from sgl_spec.specblock.fast_layer import fast_path_ok

    model = specblock_drafter()
    layer = model.layers[0]
    x = torch.zeros(1, 4, D)
    assert not fast_path_ok(layer, x)  # training mode, autograd on
    model.eval()
    assert not fast_path_ok(layer, x)  # autograd on
    with torch.no_grad():
        assert fast_path_ok(layer, x)
        assert not fast_path_ok(layer, x.to(torch.bfloat16))
