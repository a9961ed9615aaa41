"""The native CPU kernels for tests: built for this host, or the test skipped where the host
has no C++ compiler (the PyTorch ops then serve, and are tested on their own)."""

from __future__ import annotations

import shutil

import pytest

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
