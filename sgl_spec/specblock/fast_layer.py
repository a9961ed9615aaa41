"""The drafter's decoder layers and heads served on the CPU in a few native calls.

A SpecBlock drafter is one or two small Llama layers (``model.py`` builds them from
transformers' ``LlamaDecoderLayer``). On the CPU a served drafter forward of a few rows spends
most of its time in the ~100 PyTorch ops and module calls of that layer, not in arithmetic
(``benchmarks/RESULTS.md``). Without autograd, on float32 CPU weights where our native library
is built, :func:`fast_layer_forward` computes the same layer natively: where the context is a
:class:`KVWorkspace` and the head size a multiple of 16, the whole layer is one call
(``drafter_layer``, ``cpu_kernels/csrc/drafter.cpp``: norms, packed products, RoPE, the keys
written into the workspace, masked attention, residuals); otherwise the ops the target's served
forward uses (RMSNorm, RoPE, SiLU-and-mul in one native call each, q/k/v and gate/up as one
packed linear each, PyTorch's SDPA). The first layer's input, Eqs. (1)-(2), is one call too
(:func:`fused_inputs`), and so are a tree round's heads (``fast_heads.py``). All equal the
PyTorch path to float32 rounding (``tests/unit/test_specblock_serving_speed.py``,
``test_specblock_native_drafter.py``);
drafts only propose, the target verifies them, so rounding differences never change an output.
Anything else (training, other devices and dtypes, biases, another activation) keeps the
transformers layer and modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from sgl_spec.cpu_kernels import native
from sgl_spec.patches import cpu_packed_linear
from sgl_spec.specblock.workspace import KVWorkspace

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

    def current(self) -> cpu_packed_linear.PackedWeight:
        """The packed weight of the parameters as they are now."""
        key = tuple((w.data_ptr(), w._version) for w in self.sources())
        if key != self.key:
            self.weight = self.build().detach().contiguous()
            self.packed = cpu_packed_linear.PackedWeight(self.weight, self.which)
            self.key = key
        return self.packed

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        packed = self.current()
        if not packed.takes(rows.shape[0]):
            return F.linear(rows, self.weight)
        return packed.linear(rows, self.weight, None)


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
        "o": _fused([attn.o_proj], which),
        "down": _fused([mlp.down_proj], which),
        # drafter_layer's attention runs whole vectors of 16 over a head of at most 256
        "one_call": attn.head_dim % 16 == 0 and attn.head_dim <= 256,
    }


def _one_call(state: dict[str, Any], cache: Any, rows: int) -> bool:
    """Whether :func:`native_layer` serves this forward: the native layer is built and takes
    this head size, the packed weights are the native kernel's and take ``rows``, and the
    context is a :class:`KVWorkspace` (the layer writes its keys into it)."""
    packed = state["qkv"].current()
    return (
        state["one_call"]
        and packed.kind == "native"
        and packed.takes(rows)
        and isinstance(cache.context, KVWorkspace)
        and hasattr(native.ops(), "drafter_layer")
    )


def native_layer(
    layer: torch.nn.Module,
    hidden: torch.Tensor,  # [bs, n, d]
    mask: torch.Tensor,  # [bs|1, 1, n, C + n] bool
    positions: torch.Tensor,  # [bs, n]
    cos_sin: torch.Tensor,  # [max_pos, head_dim]
    cache: Any,  # model._BlockCache over a KVWorkspace
    layer_idx: int,
) -> torch.Tensor:  # [bs, n, d]
    """The layer of :func:`fast_layer_forward` in one native call
    (``cpu_kernels/csrc/drafter.cpp``): the block's keys and values are written into the
    workspace behind its visible columns, and recorded on ``cache`` as views of it."""
    state = layer._sgl_spec_fast
    attn, mlp = layer.self_attn, layer.mlp
    bs, n, d = hidden.shape
    workspace = cache.context
    start = workspace.length
    workspace.ensure_room(start + n)
    keys, values = workspace.keys[layer_idx], workspace.values[layer_idx]
    out = native.ops().drafter_layer(
        hidden.reshape(bs * n, d),
        positions.reshape(-1),
        cos_sin,
        layer.input_layernorm.weight,
        layer.input_layernorm.variance_epsilon,
        state["qkv"].current().packed,
        attn.q_proj.weight.shape[0],
        attn.k_proj.weight.shape[0],
        state["o"].current().packed,
        layer.post_attention_layernorm.weight,
        layer.post_attention_layernorm.variance_epsilon,
        state["gate_up"].current().packed,
        mlp.gate_proj.weight.shape[0],
        state["down"].current().packed,
        keys,
        values,
        start,
        mask,
        attn.scaling,
    )
    block = slice(start, start + n)
    cache.new[layer_idx] = (keys[:, block].transpose(1, 2), values[:, block].transpose(1, 2))
    return out.view(bs, n, d)


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
    bs, n, d = hidden.shape
    if _one_call(state, cache, bs * n):
        return native_layer(layer, hidden, mask, positions, cos_sin, cache, layer_idx)
    ops = native.ops()
    attn, mlp = layer.self_attn, layer.mlp
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
    packed = _prefix_packed(model)
    rows = torch.cat(
        [rms_norm(model.cond_norm, context, True), rms_norm(model.token_norm, token, True)], dim=-1
    )
    return packed(rows.reshape(-1, rows.shape[-1])).view(*rows.shape[:-1], -1)


def with_queries(
    prefix: torch.Tensor,  # [bs, S, d]
    query: torch.Tensor,  # [K, d] the position queries' term
    broadcast: bool,  # prefix broadcast: every position gets the prefix (else position 1)
) -> torch.Tensor:  # [bs, S, K, d]
    """Eq. (2)'s sum of the prefix term and each position's query term."""
    prefix = prefix.unsqueeze(2)
    if not broadcast:  # the Table 2 ablation
        first = torch.zeros(query.shape[0], 1, dtype=prefix.dtype, device=prefix.device)
        first[0] = 1
        prefix = prefix * first
    return prefix + query


def fused_inputs(
    model: torch.nn.Module,
    cond: torch.Tensor,  # [bs, S, 3*d_target] target features, or [bs, S, d] drafter state
    input_ids: torch.Tensor,  # [bs, S]
    from_draft: bool,
    query: torch.Tensor,  # [K, d]
) -> torch.Tensor:  # [bs, S, K, d]
    """The drafter's first-layer input on the CPU serving path: with prefix broadcast and the
    native op, the condition projection (target features only), both norms, the embedding
    rows, the packed ``W_fuse`` product and the query terms in one call (``drafter_fuse``,
    ``csrc/drafter.cpp``); otherwise the same from the modules and :func:`fused_prefix`."""
    bs, s = input_ids.shape
    rows = bs * s
    if _fuse_call(model, rows, from_draft):
        prefix, ops = _prefix_packed(model), native.ops()
        out = ops.drafter_fuse(
            cond.reshape(rows, -1).contiguous(),
            input_ids.reshape(-1),
            model.embed_tokens.weight,
            None if from_draft else cpu_packed_linear.current(model.cond_proj).packed,
            model.config.hidden_size,
            model.cond_norm.weight,
            model.cond_norm.variance_epsilon,
            model.token_norm.weight,
            model.token_norm.variance_epsilon,
            prefix.current().packed,
            query,
        )
        return out.view(bs, s, *query.shape)
    context = cond if from_draft else model.cond_proj(cond)
    token = model.embed_tokens(input_ids).to(context.dtype)
    return with_queries(fused_prefix(model, context, token), query, model.config.prefix_broadcast)


def _fuse_call(model: torch.nn.Module, rows: int, from_draft: bool) -> bool:
    """Whether ``drafter_fuse`` serves :func:`fused_inputs`: prefix broadcast, the native op
    built, and the packed weights it reads the native kernel's and taking ``rows``."""
    prefix = _prefix_packed(model)
    cond_proj = None if from_draft else getattr(model.cond_proj, "_sgl_spec_packed", None)
    projection_ok = from_draft or (
        cond_proj is not None and cond_proj.kind == "native" and cond_proj.takes(rows)
    )
    return (
        model.config.prefix_broadcast
        and hasattr(native.ops(), "drafter_fuse")
        and prefix.which == "native"
        and prefix.current().takes(rows)
        and projection_ok
    )


def _prefix_packed(model: torch.nn.Module) -> _Packed:
    """``W_fuse``'s condition and token column blocks, packed once for the current kernel."""
    d = model.config.hidden_size
    packed = getattr(model, "_sgl_spec_prefix", None)
    if packed is None or packed.which != cpu_packed_linear.kind():
        packed = _Packed(
            lambda: [model.fuse.weight],
            lambda: model.fuse.weight[:, :-d],
            cpu_packed_linear.kind(),
        )
        model._sgl_spec_prefix = packed
    return packed


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
