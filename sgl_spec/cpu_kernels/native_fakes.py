"""Fake (meta) implementations of the native CPU ops, for ``torch.compile`` to trace through.

SGLang's CPU graph runner (``--enable-torch-compile`` on CPU) compiles the model's forward; a
custom op without a fake implementation stops dynamo there. The library registers its kernels
for the CPU dispatch key (not catch-all), so each op below can carry a fake: one that returns
outputs of the real kernel's shape, dtype and layout without computing them, and nothing for
the ops that only write into their arguments. ``pack_linear_weight`` has none: its layout
depends on the CPU's vector width, and weights are packed before any forward is traced.
"""

from __future__ import annotations

import torch

NAMESPACE = "sgl_spec_native"
_registered: set[str] = set()


def _like(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _fakes() -> dict[str, object]:
    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _like(x)

    def rope_neox(
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        head_size: int,
        cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _like(q), _like(k)

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    def packed_linear(
        x: torch.Tensor, packed: torch.Tensor, out: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], out))

    def writes_only(*args: object) -> None:
        return None

    mutating = (
        "store_rows", "fused_add_rmsnorm", "assign_req_to_token_pool", "copy_kv_rows",
        "decode_attention", "extend_attention", "store_extend_attention", "gated_lora_add",
    )  # fmt: skip
    fakes: dict[str, object] = {name: writes_only for name in mutating}
    fakes.update(rmsnorm=rmsnorm, rope_neox=rope_neox, silu_and_mul=silu_and_mul,
                 packed_linear=packed_linear)  # fmt: skip
    return fakes


def register(ops: object) -> int:
    """Register a fake for every op of the loaded library ``ops`` that has none yet; returns
    how many were registered. A library built before its ops had CPU kernels (catch-all ones
    refuse a fake) is left as it is: eager calls work, tracing stops at them as before."""
    count = 0
    for name, fake in _fakes().items():
        if name in _registered or not hasattr(ops, name):
            continue
        try:
            torch.library.register_fake(f"{NAMESPACE}::{name}")(fake)
        except RuntimeError:
            return count
        _registered.add(name)
        count += 1
    return count
