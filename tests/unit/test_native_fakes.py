"""The native CPU ops' fake implementations (``sgl_spec/cpu_kernels/native_fakes.py``).

``torch.library.opcheck`` runs each op for real and through its fake and compares what they
return (shape, dtype, strides) and what they write; a graph of the ops that a served decoder
layer calls compiles with ``fullgraph=True`` (no graph break at any of them) and computes
exactly what the eager calls compute.
"""

from __future__ import annotations

import pytest
import torch

from sgl_spec.cpu_kernels import native_fakes
from sgl_spec.patches import cpu_packed_linear
from tests.helpers.native_kernels import cos_sin_cache, require_native

CHECKS = ("test_schema", "test_faketensor")


@pytest.fixture(scope="module")
def ops():
    return require_native()


def test_every_forward_op_has_a_fake(ops) -> None:
    for name in native_fakes._fakes():
        op = getattr(ops, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"), name


def test_fakes_match_the_kernels(ops) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    torch.library.opcheck(ops.rmsnorm, (x, w, 1e-6), test_utils=CHECKS)
    torch.library.opcheck(ops.fused_add_rmsnorm, (x.clone(), x.clone(), w, 1e-6), test_utils=CHECKS)
    torch.library.opcheck(
        ops.silu_and_mul, (torch.randn(3, 128, generator=gen),), test_utils=CHECKS
    )
    q, k = torch.randn(3, 4, 32, generator=gen), torch.randn(3, 2, 32, generator=gen)
    args = (torch.tensor([0, 5, 9]), q, k, 32, cos_sin_cache(16, 32))
    torch.library.opcheck(ops.rope_neox, args, test_utils=CHECKS)
    weight = torch.randn(40, 64, generator=gen)
    packed = ops.pack_linear_weight(weight)
    for bias in (None, torch.randn(40, generator=gen)):
        torch.library.opcheck(ops.packed_linear, (x, packed, 40, bias), test_utils=CHECKS)
    cache = torch.zeros(8, 64)
    torch.library.opcheck(ops.store_rows, (x, cache, torch.tensor([1, 4, 6])), test_utils=CHECKS)


def test_a_decoder_layers_ops_compile_without_a_break(ops) -> None:
    """RMSNorm, packed linear through the patched layer path, SiLU-and-mul, fused add + norm:
    one graph, the eager result bit for bit."""
    gen = torch.Generator().manual_seed(1)
    up, down = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(48, 64, bias=False)
    for layer in (up, down):
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen) / 8
        cpu_packed_linear.pack(layer, "native")
    norm_w = torch.randn(64, generator=gen)

    def block(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = ops.rmsnorm(x, norm_w, 1e-6)
        h = ops.silu_and_mul(cpu_packed_linear.linear(up, h, None))
        h = cpu_packed_linear.linear(down, h, None)
        ops.fused_add_rmsnorm(h, residual, norm_w, 1e-6)
        return h, residual

    x, residual = torch.randn(2, 64, generator=gen), torch.randn(2, 64, generator=gen)
    with torch.no_grad():
        want = block(x.clone(), residual.clone())
        compiled = torch.compile(block, fullgraph=True, dynamic=False, backend="aot_eager")
        got = compiled(x.clone(), residual.clone())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
