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

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from sgl_spec.cpu_kernels import native
from sgl_spec.patches import cpu_packed_linear

_NATIVE_OPS = ("rmsnorm", "rope_neox", "silu_and_mul", "packed_linear")


class _Packed:
    """A weight built from parameters (``build``: a slice, or several layers' weights
    concatenated by output rows) and packed once; built and packed again when any tensor
    ``sources()`` returns changes (looked up at each call, so a parameter replaced on its
    module is seen; in-place updates bump the version, ``.to()`` moves the storage)."""

    def __init__(
        self,
        sources: Callable[[], list[torch.Tensor]],
        build: Callable[[], torch.Tensor],
        which: str,
    ):
        self.sources = sources
        self.build = build
        self.which = which
        self.key: tuple | None = None
        self.weight = torch.empty(0)
        self.packed: cpu_packed_linear.PackedWeight | None = None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        key = tuple((w.data_ptr(), w._version) for w in self.sources())
        if key != self.key:
            self.weight = self.build().detach().contiguous()
            self.packed = cpu_packed_linear.PackedWeight(self.weight, self.which)
            self.key = key
        if not self.packed.takes(rows.shape[0]):
            return F.linear(rows, self.weight)
        return self.packed.linear(rows, self.weight, None)


def _fused(layers: list[torch.nn.Linear], which: str) -> _Packed:
    return _Packed(
        lambda: [m.weight for m in layers], lambda: torch.cat([m.weight for m in layers]), which
    )


def serving_on_cpu(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """No autograd, eval mode, float32 on the CPU, and the native kernels built and on."""
    if torch.is_grad_enabled() or module.training:
        return False
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    ops = native.ops()
    return (
        cpu_packed_linear.kind() is not None
        and ops is not None
        and all(hasattr(ops, name) for name in _NATIVE_OPS)
    )


def fast_path_ok(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether :func:`fast_layer_forward` serves ``layer`` on ``x``."""
    if not serving_on_cpu(layer, x):
        return False
    state = getattr(layer, "_sgl_spec_fast", None)
    if state is None:
        state = _prepare(layer)
        layer._sgl_spec_fast = state
    return state is not False


def _prepare(layer: torch.nn.Module) -> dict[str, Any] | bool:
    which = cpu_packed_linear.kind()
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    linears += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(m.bias is not None for m in linears):
        return False
    if getattr(mlp.config, "hidden_act", None) != "silu":
        return False
    return {
        "qkv": _fused([attn.q_proj, attn.k_proj, attn.v_proj], which),
        "gate_up": _fused([mlp.gate_proj, mlp.up_proj], which),
    }


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
    rows = rows + cpu_packed_linear.linear(attn.o_proj, out, None)
    normed = ops.rmsnorm(
        rows,
        layer.post_attention_layernorm.weight,
        layer.post_attention_layernorm.variance_epsilon,
    )
    gated = ops.silu_and_mul(state["gate_up"](normed))
    rows = rows + cpu_packed_linear.linear(mlp.down_proj, gated, None)
    return rows.view(bs, n, d)


def rms_norm(norm: torch.nn.Module, x: torch.Tensor, fast: bool) -> torch.Tensor:
    """A ``LlamaRMSNorm``: the native kernel when ``fast`` (:func:`serving_on_cpu`)."""
    if not fast:
        return norm(x)
    return native.ops().rmsnorm(x, norm.weight, norm.variance_epsilon)


def fused_prefix(
    model: torch.nn.Module, context: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    """``W_fuse[norm(c), norm(embed(x)), .]`` without the query term, as one packed product
    over the condition and token column blocks (the training path sums two products)."""
    d = model.config.hidden_size
    packed = getattr(model, "_sgl_spec_prefix", None)
    if packed is None or packed.which != cpu_packed_linear.kind():
        packed = _Packed(
            lambda: [model.fuse.weight],
            lambda: model.fuse.weight[:, :-d],
            cpu_packed_linear.kind(),
        )
        model._sgl_spec_prefix = packed
    rows = torch.cat(
        [rms_norm(model.cond_norm, context, True), rms_norm(model.token_norm, token, True)], dim=-1
    )
    return packed(rows.reshape(-1, rows.shape[-1])).view(*rows.shape[:-1], -1)


def rope_table(
    model: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # cos, sin [1, N, hd]; cos_sin
    """On the CPU without autograd, for the default rope: a table of ``model.rotary``'s
    ``(cos, sin)`` for positions 0..N-1 covering ``position_ids``, computed once (every entry is
    element-wise in its position, so a row equals what the module returns for that position
    alone) and doubled when a position passes its end, with the native rope's ``cos_sin``
    layout beside it. None elsewhere (on a GPU, sizing the table would need a host sync per
    forward)."""
    rotary = model.rotary
    if (
        torch.is_grad_enabled()
        or x.device.type != "cpu"
        or getattr(rotary, "rope_type", "default") != "default"
    ):
        return None
    need = int(position_ids.max()) + 1 if position_ids.numel() else 1
    key = (x.dtype, rotary.inv_freq.data_ptr(), rotary.inv_freq._version)
    table = getattr(model, "_rope_table", None)
    if table is None or table[0] != key or table[1].shape[1] < need:
        size = max(need, 2 * table[1].shape[1] if table is not None else 256)
        cos, sin = rotary(x, torch.arange(size, device=x.device)[None])
        half = cos.shape[-1] // 2  # each is cat(f, f): the native rope reads one half of each
        cos_sin = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).contiguous()
        table = (key, cos, sin, cos_sin)
        model._rope_table = table
    return table[1:]


def rotary_rows(
    model: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [bs, n, head_dim]
    """The rotary ``(cos, sin)`` of ``position_ids``: rows of :func:`rope_table` where it
    applies, else the module itself."""
    table = rope_table(model, x, position_ids)
    if table is None:
        return model.rotary(x, position_ids)
    return table[0][0][position_ids], table[1][0][position_ids]
