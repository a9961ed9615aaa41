"""The native CPU kernels for tests: built for this host, or the test skipped where the host
has no C++ compiler (the PyTorch ops then serve, and are tested on their own)."""

from __future__ import annotations

import shutil

import pytest
import torch

from sgl_spec.cpu_kernels import native


def require_native(monkeypatch: pytest.MonkeyPatch | None = None) -> object:
    """``torch.ops.sgl_spec_native``, built if missing; a build failure on a host with a
    compiler fails the test."""
    if shutil.which(native._compiler()) is None:
        pytest.skip(f"no C++ compiler ({native._compiler()}) on this host")
    assert native.ensure_built() is not None, "the native kernels must build on this host"
    if monkeypatch is not None:
        monkeypatch.delitem(native._state, "ops", raising=False)
    else:
        native._state.pop("ops", None)
    ops = native.ops()
    assert ops is not None
    return ops


def cos_sin_cache(max_pos: int, dim: int) -> torch.Tensor:
    """A neox RoPE cache [max_pos, dim]: the cos half, then the sin half."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
