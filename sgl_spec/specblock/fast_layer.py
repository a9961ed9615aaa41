"""The drafter's decoder layers served on the CPU in a few native calls.

A SpecBlock drafter is one or two small Llama layers (``model.py`` builds them from
transformers' ``LlamaDecoderLayer``). On the CPU a served drafter forward of a few rows spends
most of its time in the ~100 PyTorch ops and module calls of that layer, not in arithmetic
(``benchmarks/RESULTS.md``). Without autograd, on float32 CPU weights where our native library
is built, :func:`fast_layer_forward` computes the same layer with the ops the target's served
forward uses: RMSNorm, RoPE and SiLU-and-mul in one native call each, q/k/v and gate/up as one
packed linear each (``cpu_packed_linear``), PyTorch's SDPA for the attention. It equals the
transformers layer to float32 rounding (``tests/unit/test_specblock_serving_speed.py``);
drafts only propose, the target verifies them, so rounding differences never change an output.
Anything else (training, other devices and dtypes, biases, another activation) keeps the
transformers layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sgl_spec.cpu_kernels import native
from sgl_spec.patches import cpu_packed_linear

_NATIVE_OPS = ("rmsnorm", "rope_neox", "silu_and_mul", "packed_linear")


class _Fused:
    """Several linear layers' weights concatenated by output rows and packed once; packed again
    when any of them changes (in-place updates bump the version, ``.to()`` makes new tensors)."""

    def __init__(self, layers: list[torch.nn.Linear], which: str) -> None:
        self.layers = layers
        self.which = which
        self.key: tuple | None = None
        self.weight = torch.empty(0)
        self.packed: cpu_packed_linear.PackedWeight | None = None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        key = tuple((m.weight.data_ptr(), m.weight._version) for m in self.layers)
        if key != self.key:
            self.weight = torch.cat([m.weight.detach() for m in self.layers])
            self.packed = cpu_packed_linear.PackedWeight(self.weight, self.which)
            self.key = key
        if not self.packed.takes(rows.shape[0]):
            return F.linear(rows, self.weight)
        return self.packed.linear(rows, self.weight, None)


def fast_path_ok(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether :func:`fast_layer_forward` serves ``layer`` on ``x``."""
    if torch.is_grad_enabled() or layer.training:
        return False
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    state = getattr(layer, "_sgl_spec_fast", None)
    if state is None:
        state = _prepare(layer)
        layer._sgl_spec_fast = state
    return state is not False


def _prepare(layer: torch.nn.Module) -> dict[str, Any] | bool:
    which = cpu_packed_linear.kind()
    ops = native.ops()
    if which is None or ops is None or not all(hasattr(ops, name) for name in _NATIVE_OPS):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    linears += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(m.bias is not None for m in linears):
        return False
    if getattr(mlp.config, "hidden_act", None) != "silu":
        return False
    return {
        "qkv": _Fused([attn.q_proj, attn.k_proj, attn.v_proj], which),
        "gate_up": _Fused([mlp.gate_proj, mlp.up_proj], which),
    }


def _project(layer: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    out = cpu_packed_linear.packed_linear(layer, rows, None)
    return F.linear(rows, layer.weight) if out is None else out


def fast_layer_forward(
    layer: torch.nn.Module,
    hidden: torch.Tensor,  # [bs, n, d]
    mask: torch.Tensor,  # [bs|1, 1, n, C + n] bool
    positions: torch.Tensor,  # [bs, n]
    cos_sin: torch.Tensor,  # [max_pos, head_dim]: cos of the first half, then sin
    cache: Any,  # model._BlockCache
    layer_idx: int,
) -> torch.Tensor:  # [bs, n, d]
    """One ``LlamaDecoderLayer`` forward (pre-norm attention and gated MLP, residuals)."""
    state = layer._sgl_spec_fast
    ops = native.ops()
    attn, mlp = layer.self_attn, layer.mlp
    bs, n, d = hidden.shape
    hd = attn.head_dim
    rows = hidden.reshape(bs * n, d)
    normed = ops.rmsnorm(rows, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
    qkv = state["qkv"](normed)
    q_width = attn.q_proj.weight.shape[0]
    kv_width = attn.k_proj.weight.shape[0]
    q, k = ops.rope_neox(
        positions.reshape(-1),
        qkv[:, :q_width],
        qkv[:, q_width : q_width + kv_width],
        hd,
        cos_sin,
    )
    v = qkv[:, q_width + kv_width :]
    query = q.view(bs, n, -1, hd).transpose(1, 2)
    key = k.view(bs, n, -1, hd).transpose(1, 2)
    value = v.reshape(bs, n, -1, hd).transpose(1, 2)
    key, value = cache.update(key, value, layer_idx)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        scale=attn.scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    out = out.transpose(1, 2).reshape(bs * n, q_width)
    rows = rows + _project(attn.o_proj, out)
    normed = ops.rmsnorm(
        rows,
        layer.post_attention_layernorm.weight,
        layer.post_attention_layernorm.variance_epsilon,
    )
    rows = rows + _project(mlp.down_proj, ops.silu_and_mul(state["gate_up"](normed)))
    return rows.view(bs, n, d)
