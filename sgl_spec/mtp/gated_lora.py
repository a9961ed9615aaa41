"""Gated LoRA and the MTP adapter (paper §4.3, after Samragh et al. 2025).

In every LoRA-enabled linear layer a binary gate ``g`` is applied per position::

    Y = X W + (g ⊙ X) A Bᵀ · alpha / rank

Anchor positions (``g = 0``) take the base weights only, so verification is *exactly* the target
model; mask positions (``g = 1``) also traverse the LoRA path and produce the multi-token drafts.
"Exactly" is meant bit for bit: the delta is computed on the gated rows only and added into those
rows, every other row of the base output is left untouched (never ``+ 0``).

The adapter also holds one learned input embedding per mask slot. The base embedding rows are
never modified: the shipped target ties them to ``lm_head``, so changing them would change the
base logits. Instead the mask embeddings replace the looked-up embedding at mask positions.

The on-disk format (``save_adapter`` / ``load_adapter``) lives in ``adapter_io``. Pure PyTorch; the Hugging Face attachment uses forward hooks, so the model's modules, parameter
names and state dict are unchanged and ``detach()`` restores the plain model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from sgl_spec.mtp.config import ATTN_MODULES, AdapterError, BaseDims, MtpAdapterConfig

__all__ = [
    "AdapterError",
    "BaseDims",
    "GatedLoRA",
    "MtpAdapter",
    "MtpAdapterConfig",
    "MtpHandle",
    "attach_to_hf_model",
    "gated_lora_reference",
]


def gated_lora_reference(
    x: torch.Tensor,  # [n, in]
    gate: torch.Tensor,  # [n]
    lora_A: torch.Tensor,  # [r, in]
    lora_B: torch.Tensor,  # [out, r]
    scaling: float,
) -> torch.Tensor:  # [n, out]
    """The paper's formula evaluated densely on every row: ``(g ⊙ X) A Bᵀ · scaling``."""
    return (gate[:, None].to(x.dtype) * x) @ lora_A.T @ lora_B.T * scaling


class GatedLoRA(nn.Module):
    """Low-rank delta of one linear layer, applied only on gated rows.

    ``lora_B`` starts at zero, so a fresh adapter is the identity even on gated rows; ``lora_A``
    gets the LoRA reference initialisation (uniform, bound ``1/sqrt(in)``).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)
            self.lora_B.zero_()

    def _rows_delta(
        self,
        x_rows: torch.Tensor,  # [n, in]
        gate_rows: torch.Tensor,  # [n]
    ) -> torch.Tensor:  # [n, out]
        a, b = self.lora_A.to(x_rows.dtype), self.lora_B.to(x_rows.dtype)
        return ((gate_rows[:, None].to(x_rows.dtype) * x_rows) @ a.T) @ b.T * self.scaling

    def add_to(
        self,
        y: torch.Tensor,  # [N, out] base output
        x: torch.Tensor,  # [N, in] base input
        rows: torch.Tensor | None,  # [n] long gated rows; None: every row is gated
        gate_rows: torch.Tensor,  # [n] (or [N]) the gate values of those rows
    ) -> torch.Tensor:  # [N, out]
        """``y`` plus the delta on ``rows``; every other row of the result is ``y``'s, bitwise."""
        if rows is None:
            return y + self._rows_delta(x, gate_rows).to(y.dtype)
        if rows.numel() == 0:
            return y
        delta = self._rows_delta(x.index_select(0, rows), gate_rows)
        return y.index_add(0, rows, delta.to(y.dtype))

    def delta(
        self,
        x: torch.Tensor,  # [N, in]
        gate: torch.Tensor,  # [N]
    ) -> torch.Tensor:  # [N, out], exact zeros where gate == 0
        """``(g ⊙ X) A Bᵀ · scaling``, computed only on the rows where ``gate`` is nonzero."""
        rows = gate.nonzero().squeeze(1)
        zeros = x.new_zeros(x.shape[0], self.out_features)
        return self.add_to(zeros, x, rows, gate.index_select(0, rows))


class MtpAdapter(nn.Module):
    """Per decoder layer, one :class:`GatedLoRA` per target module; plus ``mask_embeddings``.

    State-dict keys: ``layers.{i}.{module}.lora_A`` / ``.lora_B`` and ``mask_embeddings``
    (``[k_max, hidden]``, row ``j-1`` for mask slot ``j``).
    """

    def __init__(self, config: MtpAdapterConfig, dims: BaseDims) -> None:
        super().__init__()
        self.config, self.dims = config, dims
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    m: GatedLoRA(*dims.module_shape(m), config.rank, config.alpha)
                    for m in config.target_modules
                }
            )
            for _ in range(dims.num_layers)
        )
        self.mask_embeddings = nn.Parameter(torch.zeros(config.k_max, dims.hidden_size))

    def lora(self, layer: int, module: str) -> GatedLoRA:
        return self.layers[layer][module]  # type: ignore[index]

    def reset_parameters(
        self,
        embed_weight: torch.Tensor,  # [vocab, hidden] the base input embedding
        generator: torch.Generator | None = None,
        noise: float = 0.1,
    ) -> None:
        """Fresh LoRA factors, and mask embeddings = mean token embedding + ``noise`` x its std.

        Starting at the mean embedding puts the mask inputs in the range the base layers were
        trained on; the noise makes the ``k_max`` slots distinguishable from step one.
        """
        for layer in self.layers:
            for lora in layer.values():  # type: ignore[union-attr]
                lora.reset_parameters(generator)
        emb = embed_weight.detach().float()
        noise_t = torch.randn(self.mask_embeddings.shape, generator=generator)
        with torch.no_grad():
            self.mask_embeddings.copy_(emb.mean(0) + noise * emb.std() * noise_t)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass(frozen=True)
class _GateState:
    """The gate of one forward, flattened to rows and pre-indexed once for all layers."""

    num_rows: int
    rows: torch.Tensor | None  # [n] long, rows with a nonzero gate; None when all are
    gate_rows: torch.Tensor  # [n]
    mask_rows: torch.Tensor  # [m] long, rows whose input embedding is a mask embedding
    mask_ids: torch.Tensor  # [m] long, 0..k_max-1

    @classmethod
    def build(cls, gate: torch.Tensor, mask_index: torch.Tensor | None, k_max: int) -> _GateState:
        g = gate.reshape(-1)
        if g.dtype == torch.bool:
            g = g.float()
        rows = g.nonzero().squeeze(1)
        if mask_index is None:
            mask_rows = mask_ids = rows.new_zeros(0)
        else:
            m = mask_index.reshape(-1)
            if m.numel() != g.numel():
                raise ValueError(
                    f"mask_index has {m.numel()} entries but gate has {g.numel()}; give one per position"
                )
            mask_rows = (m >= 0).nonzero().squeeze(1)
            mask_ids = m.index_select(0, mask_rows).long()
            if mask_ids.numel() and int(mask_ids.max()) >= k_max:
                raise ValueError(
                    f"mask_index values must be in [-1, {k_max - 1}] (k_max={k_max}), got {int(mask_ids.max())}"
                )
        if rows.numel() == g.numel():  # every row gated (a mask-only forward): skip the gathers
            return cls(g.numel(), None, g, mask_rows, mask_ids)
        return cls(g.numel(), rows, g.index_select(0, rows), mask_rows, mask_ids)


class MtpHandle:
    """An adapter attached to a Hugging Face model (see :func:`attach_to_hf_model`).

    Outside :meth:`gates` the model is the plain base model. Inside, the gate of the *next*
    forwards is the given one::

        with attach_to_hf_model(model, adapter) as handle, handle.gates(gate, mask_index):
            logits = model(input_ids=ids, attention_mask=mask4d, position_ids=pos).logits
    """

    def __init__(self, model: nn.Module, adapter: MtpAdapter) -> None:
        self.model, self.adapter = model, adapter
        self._state: _GateState | None = None
        self._hooks: list[Any] = []
        layers = _decoder_layers(model)
        if len(layers) != adapter.dims.num_layers:
            raise AdapterError(
                f"adapter has {adapter.dims.num_layers} layers, model has {len(layers)} decoder layers"
            )
        for i, layer in enumerate(layers):
            for name in adapter.config.target_modules:
                linear = _target_linear(layer, name)
                lora = adapter.lora(i, name)
                if (linear.in_features, linear.out_features) != (
                    lora.in_features,
                    lora.out_features,
                ):
                    raise AdapterError(
                        f"layer {i} {name}: model is {linear.in_features}->{linear.out_features}, "
                        f"adapter is {lora.in_features}->{lora.out_features}"
                    )
                self._hooks.append(linear.register_forward_hook(partial(self._linear_hook, lora)))
        embed = model.get_input_embeddings()
        if embed.embedding_dim != adapter.dims.hidden_size:
            raise AdapterError(
                f"model embedding dim {embed.embedding_dim} != adapter hidden size {adapter.dims.hidden_size}"
            )
        self._hooks.append(embed.register_forward_hook(self._embed_hook))

    @contextmanager
    def gates(
        self,
        gate: torch.Tensor,  # [bs, T] or [bs * T]: 0 = base path, nonzero = LoRA path
        mask_index: torch.Tensor | None = None,  # same shape: mask slot j-1, or -1 if not a mask
    ) -> Iterator[MtpHandle]:
        """Gate the forwards run inside the block; ``mask_index >= 0`` rows get mask embeddings."""
        previous = self._state
        self._state = _GateState.build(gate, mask_index, self.adapter.config.k_max)
        try:
            yield self
        finally:
            self._state = previous

    def _check_rows(self, state: _GateState, rows: int) -> None:
        if rows != state.num_rows:
            raise ValueError(
                f"gate has {state.num_rows} entries but the forward has {rows} positions (batch x length)"
            )

    def _linear_hook(
        self, lora: GatedLoRA, module: nn.Module, args: tuple, output: torch.Tensor
    ) -> torch.Tensor | None:
        state = self._state
        if state is None:
            return None
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1])  # [bs * T, in]
        self._check_rows(state, x2.shape[0])
        if state.rows is not None and state.rows.numel() == 0:
            return None
        y2 = output.reshape(-1, output.shape[-1])  # [bs * T, out]
        return lora.add_to(y2, x2, state.rows, state.gate_rows).view(output.shape)

    def _embed_hook(
        self, module: nn.Module, args: tuple, output: torch.Tensor
    ) -> torch.Tensor | None:
        state = self._state
        if state is None:
            return None
        flat = output.reshape(-1, output.shape[-1])  # [bs * T, hidden]
        self._check_rows(state, flat.shape[0])
        if state.mask_rows.numel() == 0:
            return None
        rows = self.adapter.mask_embeddings.index_select(0, state.mask_ids).to(flat.dtype)
        return flat.index_copy(0, state.mask_rows, rows).view(output.shape)

    def detach(self) -> None:
        """Remove every hook: the model is the plain base model again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._state = None

    def __enter__(self) -> MtpHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise AdapterError(
            f"{type(model).__name__} has no .model.layers; only Llama/Qwen3-style causal LMs are supported"
        )
    return layers


def _target_linear(layer: nn.Module, name: str) -> nn.Linear:
    parent = getattr(layer, "self_attn" if name in ATTN_MODULES else "mlp", None)
    linear = getattr(parent, name, None)
    if not isinstance(linear, nn.Linear):
        raise AdapterError(f"decoder layer has no nn.Linear {name!r} (in self_attn/mlp)")
    return linear


def attach_to_hf_model(model: nn.Module, adapter: MtpAdapter) -> MtpHandle:
    """Hook ``adapter`` into a Hugging Face Llama/Qwen3 model; returns the handle.

    Wrapped: ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj`` (those in the
    adapter's ``target_modules``) of every decoder layer, and the input embedding. Works with any
    batch shape: hidden states ``[bs, T, H]`` are handled as ``bs * T`` rows, matched row for row
    with the gate. The base model's parameters are neither copied nor modified.
    """
    return MtpHandle(model, adapter)
