"""Patch: a Llama model on one CPU rank runs its layer stack without SGLang's stage boundaries.

Upstream target: ``sglang.srt.models.llama.LlamaModel.forward`` (SGLang 0.5.23). Each decoder
layer passes its residual stream through ``attn_boundary`` / ``ffn_boundary``
(``layers/layer_boundary``): a plan per forward mode that, across tensor-parallel ranks, places
the all-reduce, fuses it with the next norm, gathers rows for data-parallel attention and
quantizes the norm's output. On a single rank of unquantized weights all of that reduces to the
classic residual pair (``input_layernorm`` / ``post_attention_layernorm`` adding the residual
and normalising, in one fused op each), yet the plan is still walked in Python four times a
layer: ~80 us a layer on the 2-vCPU CPU host, 9% of the shipped target's decode and 13-17% of
the draft model's (``benchmarks/RESULTS.md``, 2026-12-05).

Where a model is exactly ``LlamaModel`` of ``LlamaDecoderLayer``s on one pipeline stage, every
projection on one tensor-parallel rank with unquantized CPU weights, the patched forward runs
the same modules in the same order with the same residual pair -- the norms' fused add and
normalisation, attention, MLP, the final norm -- so the logits are bit-identical
(``tests/unit/test_cpu_plain_llama.py``). Layers named in ``layers_to_capture`` (EAGLE3-style
target features, which SPECBLOCK and MINEDRAFT read) get the residual stream at their input,
as upstream's boundaries capture it. Anything else (input embeddings, pipeline proxies, an idle
or empty batch, hidden states before the final norm, another model class) takes upstream's
forward. ``SGLSPEC_CPU_PLAIN_LLAMA=0`` turns the patch off.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.models.llama"
ENV_SWITCH = "SGLSPEC_CPU_PLAIN_LLAMA"
_AUX_LIST: dict[str, type] = {}  # upstream's AuxHiddenStateList, set by apply()
_PARAMS = ["self", "input_ids", "positions", "forward_batch", "input_embeds", "pp_proxy_tensors"]


def enabled(config: SpecConfig) -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    module = importlib.import_module(TARGET)
    model, layer = getattr(module, "LlamaModel", None), getattr(module, "LlamaDecoderLayer", None)
    if model is None or layer is None or getattr(module, "AuxHiddenStateList", None) is None:
        raise RuntimeError(f"{TARGET}: LlamaModel, LlamaDecoderLayer or AuxHiddenStateList gone")
    params = list(inspect.signature(model.forward).parameters)
    if params != _PARAMS:
        raise RuntimeError(f"{TARGET}.LlamaModel.forward params: {params}")
    layer_source = inspect.getsource(layer.forward)
    model_source = inspect.getsource(model.forward)
    for text in ("attn_boundary.prepare", "self.self_attn(", "ffn_boundary.prepare", "self.mlp("):
        if text not in layer_source:
            raise RuntimeError(f"{TARGET}.LlamaDecoderLayer.forward changed: {text!r} gone")
    for text in ("layers_to_capture", "residual_batch.final_norm", "self.embed_tokens("):
        if text not in model_source:
            raise RuntimeError(f"{TARGET}.LlamaModel.forward changed: {text!r} gone")


def _base(module: Any) -> Any:
    """A LoRA wrapper's base layer, else the module."""
    return getattr(module, "base_layer", module)


def _one_rank_unquantized(linear: Any) -> bool:
    """Unquantized, its output and (QKV) key/value groups of one rank each: no reduction or
    gather is owed to the boundary after it."""
    from sglang.srt.distributed.utils import get_group_rank_size

    base = _base(linear)
    method = type(getattr(base, "quant_method", None)).__name__
    groups = [getattr(base, name, None) for name in ("tp_group", "kv_tp_group")]
    return method == "UnquantizedLinearMethod" and all(
        get_group_rank_size(group)[1] == 1 for group in groups
    )


def plain_stack(model: Any) -> bool:
    """Whether ``model`` (a ``LlamaModel``) is one the plain forward serves (module docstring);
    decided once per model."""
    known = model.__dict__.get("_sgl_spec_plain")
    if known is not None:
        return known
    module = importlib.import_module(TARGET)
    layers = list(model.layers)
    embed = getattr(model, "embed_tokens", None)
    plain = (
        type(model) is module.LlamaModel
        and model.pp_group.is_first_rank
        and model.pp_group.is_last_rank
        and bool(layers)
        and all(type(layer) is module.LlamaDecoderLayer for layer in layers)
        and getattr(_base(embed), "tp_size", None) == 1
        and getattr(embed, "weight", torch.empty(0, device="meta")).device.type == "cpu"
        and all(
            _one_rank_unquantized(linear)
            for layer in layers
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        )
    )
    model.__dict__["_sgl_spec_plain"] = plain
    return plain


def plain_forward(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any):
    """The layer stack as the residual pair (module docstring); returns what upstream's
    forward returns: the normed hidden states, with the captured features if any."""
    # the class looked up at apply(): torch.compile cannot trace an import_module call here
    captured = _AUX_LIST["cls"]()
    capture_at = set(model.layers_to_capture)
    hidden = model.embed_tokens(input_ids)
    residual = None
    for i, layer in enumerate(model.layers):
        if residual is None:
            residual = hidden
            hidden = layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        if i in capture_at:
            captured.capture(residual)  # the stream at the layer's input, copied
        hidden = layer.self_attn(positions=positions, hidden_states=hidden, forward_batch=batch)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden, forward_batch=batch)
    hidden, _ = model.norm(hidden, residual)
    return (hidden, captured) if len(captured) else hidden


def _serves(model: Any, input_ids, batch: Any, input_embeds, pp_proxy_tensors) -> bool:
    return (
        input_embeds is None
        and pp_proxy_tensors is None
        and input_ids is not None
        and input_ids.numel() > 0
        and not batch.forward_mode.is_idle()
        and not getattr(batch, "return_hidden_states_before_norm", False)
        and plain_stack(model)
    )


def _patched(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(
        self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None
    ):
        if _serves(self, input_ids, forward_batch, input_embeds, pp_proxy_tensors):
            return plain_forward(self, input_ids, positions, forward_batch)
        return original(self, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)

    forward._sgl_spec_patched = True  # type: ignore[attr-defined]
    forward._sgl_spec_original = original  # type: ignore[attr-defined]
    return forward


def apply() -> bool:
    module = importlib.import_module(TARGET)
    _AUX_LIST["cls"] = module.AuxHiddenStateList
    cls = module.LlamaModel
    if getattr(cls.forward, "_sgl_spec_patched", False):
        return False
    cls.forward = _patched(cls.forward)
    return True
