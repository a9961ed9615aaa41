"""``benchmarks/ops_ab.py``: the ops of a git revision load beside this checkout's and compute
the same as they do where nothing changed between the two."""

from __future__ import annotations

import torch
from ops_ab import load_base_ops

from sgl_spec.cpu_kernels import attention, layers


def test_base_ops_load_and_match_this_checkout_at_head() -> None:
    base = load_base_ops("HEAD")
    names = {op.name for op in (*attention.OPS, *layers.OPS)}
    assert names <= set(base)
    assert base["rmsnorm_cpu"] is not layers.rmsnorm  # a separate copy, not this module
    x, w = torch.randn(3, 16), torch.randn(16)
    assert torch.equal(base["rmsnorm_cpu"](x, w, 1e-5), layers.rmsnorm(x, w, 1e-5))
