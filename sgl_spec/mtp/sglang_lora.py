"""Gated LoRA inside SGLang's own target model (paper §4.3: Y = XW + (g ⊙ X)ABᵀ).

The MTP_LORA worker runs one target forward per step in which anchors (gate 0) verify and mask
tokens (gate 1) draft. SGLang's Llama/Qwen3 layers fuse projections (``qkv_proj`` = q|k|v,
``gate_up_proj`` = gate|up), so each wrapped module adds the concatenation of the per-projection
LoRA deltas, and only on the gated rows: the rows of anchors are never touched, which keeps the
verifier bit-identical to the base model. Mask tokens get the adapter's own embeddings (the
shipped target ties its embedding to the LM head, so base rows must stay as they are).

The gate is per forward: the worker sets it with ``GatedLoRA.gates(rows, mask_index)`` around
the forward; outside that context every wrapped module is the base module. Tensor parallelism is
not supported (the worker refuses tp > 1 at start-up).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# SGLang fused module -> the HF projections it concatenates, in output order.
FUSED_MODULES = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass
class _Gate:
    rows: torch.Tensor | None = None  # [num_gated] flat token rows of this forward
    mask_index: torch.Tensor | None = None  # [num_gated] which mask embedding, 0-based


class _Delta(nn.Module):
    """LoRA factors of one fused module: deltas are concatenated along the output dim."""

    def __init__(self, factors: list[tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        super().__init__()
        self.a = nn.ParameterList([nn.Parameter(a, requires_grad=False) for a, _ in factors])
        self.b = nn.ParameterList([nn.Parameter(b, requires_grad=False) for _, b in factors])
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, in] -> [n, sum(out)]
        parts = [(x @ a.t()) @ b.t() for a, b in zip(self.a, self.b, strict=True)]
        return torch.cat(parts, dim=-1) * self.scaling


class GatedLoRA:
    """Installed adapter: holds the gate and the deltas; ``gates()`` activates them."""

    def __init__(self, mask_embeddings: torch.Tensor, k_max: int) -> None:
        self.mask_embeddings = mask_embeddings  # [k_max, hidden]
        self.k_max = k_max
        self._gate = _Gate()
        self.deltas: dict[str, _Delta] = {}

    @contextlib.contextmanager
    def gates(self, rows: torch.Tensor, mask_index: torch.Tensor) -> Iterator[None]:
        """rows: [num_gated] flat token rows on the LoRA path; mask_index: [num_gated]."""
        self._gate = _Gate(rows, mask_index)
        try:
            yield
        finally:
            self._gate = _Gate()

    def _add_delta(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = self._gate.rows
        if rows is None or rows.numel() == 0:
            return out
        delta = self.deltas[name](x.index_select(0, rows).to(self.mask_embeddings.dtype))
        return out.index_add(0, rows, delta.to(out.dtype))

    def _embed(self, out: torch.Tensor) -> torch.Tensor:
        rows = self._gate.rows
        if rows is None or rows.numel() == 0:
            return out
        emb = self.mask_embeddings.index_select(0, self._gate.mask_index).to(out.dtype)
        return out.index_copy(0, rows, emb)


def _wrap_linear(module: nn.Module, adapter: GatedLoRA, name: str) -> None:
    base_forward = module.forward

    def forward(x: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = base_forward(x, *args, **kwargs)
        if isinstance(out, tuple):
            return (adapter._add_delta(name, x, out[0]), *out[1:])
        return adapter._add_delta(name, x, out)

    module.forward = forward


def _wrap_embedding(module: nn.Module, adapter: GatedLoRA) -> None:
    base_forward = module.forward

    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        return adapter._embed(base_forward(input_ids))

    module.forward = forward


def install_gated_lora(
    model: nn.Module,
    path: str | Path,
    hf_config: object,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> GatedLoRA:
    """Wrap an SGLang Llama/Qwen3-style model's projections and embedding with the adapter.

    ``load_adapter`` checks the files and every shape against the model's HF config; what is
    left to check here is that SGLang's fused modules split the way the HF projections do."""
    from sgl_spec.mtp.adapter_io import load_adapter

    loaded, config = load_adapter(path, hf_config)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens"):
        raise ValueError(
            f"MTP_LORA: model {type(model).__name__} has no model.layers/embed_tokens;"
            " only Llama/Qwen3-style decoder models are supported"
        )
    adapter = GatedLoRA(
        loaded.mask_embeddings.detach().to(device=device, dtype=dtype), config.k_max
    )
    scaling = config.alpha / config.rank
    for i, layer in enumerate(layers):
        for fused, parts in FUSED_MODULES.items():
            owner, attr = fused.split(".")
            target = getattr(getattr(layer, owner), attr)
            factors = []
            for part in parts:
                if part in config.target_modules:
                    lora = loaded.lora(i, part)
                    a, b = lora.lora_A.detach(), lora.lora_B.detach()
                else:  # a projection the adapter leaves alone: zero delta
                    a = torch.zeros(config.rank, _in_dim(target))
                    b = torch.zeros(_out_sizes(target, len(parts))[parts.index(part)], config.rank)
                factors.append((a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)))
            _check_shapes(target, fused, parts, factors)
            name = f"{i}.{fused}"
            adapter.deltas[name] = _Delta(factors, scaling)
            _wrap_linear(target, adapter, name)
        dual = getattr(layer.mlp, "dual_gemm", None)
        if dual is not None:  # a fused path would bypass gate_up_proj's forward
            dual.can_run = lambda *args, **kwargs: False
    _wrap_embedding(inner.embed_tokens, adapter)
    return adapter


def _in_dim(module: nn.Module) -> int:
    """Input width from SGLang's linear metadata (weights may be repacked on CPU/AMX)."""
    return int(getattr(module, "input_size_per_partition", None) or module.input_size)


def _out_sizes(module: nn.Module, num_parts: int) -> list[int]:
    sizes = getattr(module, "output_partition_sizes", None) or [module.output_size]
    if len(sizes) != num_parts:
        raise ValueError(f"MTP_LORA: expected {num_parts} fused outputs, got {list(sizes)}")
    return [int(x) for x in sizes]


def _check_shapes(
    module: nn.Module,
    fused: str,
    parts: tuple[str, ...],
    factors: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    in_dim, out_sizes = _in_dim(module), _out_sizes(module, len(parts))
    for part, size, (a, b) in zip(parts, out_sizes, factors, strict=True):
        if a.shape[1] != in_dim or b.shape[1] != a.shape[0] or b.shape[0] != size:
            raise ValueError(
                f"--mtp-lora-path: {part} factors A{tuple(a.shape)} B{tuple(b.shape)} do not fit"
                f" the model's {fused} (input {in_dim}, output {size})"
            )
