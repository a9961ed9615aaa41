"""The SpecBlock drafter (paper §3.1-3.2): one forward drafts a block of K dependent positions.

Inputs per start (Eqs. 1-2): a condition (the target's low/mid/top hidden states through
``W_cond``, or for later blocks the drafter's own cached last-layer state, Algorithm 2), the
embedding of the start token (the target's embedding, frozen; App. A.1) and K learned position
queries, fused by ``W_fuse``. L Llama decoder layers run over the K block positions under the
block mask of App. A.2 (causal inside the block, plus any cached context keys the caller makes
visible), with the layer-wise shift ``W_shift`` of Eq. (3) between consecutive layers. The
lm_head reads a reduced draft vocabulary; ``d2t`` maps draft ids to target ids. The rank head
(§3.2) reads the detached state and ``psi(p)``.

This module is the ``nn.Module`` (with its safetensors save/load and the frequency-ranked draft
vocabulary); its configuration and checkpoint format are ``config.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from sgl_spec.specblock.config import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, SpecBlockConfig
from sgl_spec.specblock.fast_heads import served_heads
from sgl_spec.specblock.fast_layer import (
    fast_layer_forward,
    fast_path_ok,
    fused_inputs,
    rope_table,
    rotary_rows,
    serving_on_cpu,
    with_queries,
)
from sgl_spec.specblock.mask import ContextKV, block_attention_mask
from sgl_spec.specblock.rank import RankHead
from sgl_spec.specblock.tree import BlockProposal
from sgl_spec.specblock.workspace import KVWorkspace


@dataclass
class BlockOutput:
    """One drafter forward over ``S`` starts of ``K`` positions each."""

    logits: torch.Tensor | None  # [bs, S, K, V_d] draft logits; None when heads were skipped
    rank_logits: torch.Tensor | None  # [bs, S, K, 4]; None when the rank head is ablated
    hidden: torch.Tensor  # [bs, S, K, d] last-layer states h^(L), cached for later blocks
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [bs, n_kv, S*K, head_dim] each
    proposal: BlockProposal | None = None  # top ``propose`` tokens per position, when asked


class _BlockCache:
    """A stand-in for transformers' ``Cache``: the caller's context keys/values ahead of each
    layer's block's, whose own it records. A :class:`KVWorkspace` takes the block's keys behind
    its visible columns; a per-layer list is concatenated (training: autograd needs it)."""

    def __init__(self, context: ContextKV | KVWorkspace | None, num_layers: int) -> None:
        self.context = context
        self.new: list[tuple[torch.Tensor, torch.Tensor]] = [None] * num_layers  # type: ignore[list-item]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kw: Any):
        self.new[layer_idx] = (key, value)
        if self.context is None:
            return key, value
        if isinstance(self.context, KVWorkspace):
            return self.context.append(layer_idx, key, value)
        ctx_k, ctx_v = self.context[layer_idx]
        return torch.cat([ctx_k, key], dim=2), torch.cat([ctx_v, value], dim=2)


def _num_context(context: ContextKV | KVWorkspace | None) -> int:
    if context is None:
        return 0
    if isinstance(context, KVWorkspace):
        return context.length
    return int(context[0][0].shape[2])


class SpecBlockDrafter(nn.Module):
    """The drafter block of §3.1 with the rank head of §3.2 (which reads ``norm(h^(L))``, the
    state the lm_head reads; the un-normed ``h^(L)`` is what later blocks condition on)."""

    def __init__(self, config: SpecBlockConfig) -> None:
        super().__init__()
        self.config = config
        d, dt, k = config.hidden_size, config.target_hidden_size, config.block_size
        layer_cfg = config.llama_config()
        eps = layer_cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.target_vocab_size, dt)
        self.embed_tokens.weight.requires_grad_(False)  # frozen target embedding (App. A.1)
        self.cond_proj = nn.Linear(3 * dt, d, bias=False)  # W_cond, Eq. (1)
        self.cond_norm = LlamaRMSNorm(d, eps=eps)
        self.token_norm = LlamaRMSNorm(dt, eps=eps)
        self.query_norm = LlamaRMSNorm(d, eps=eps)
        self.position_queries = nn.Parameter(torch.randn(k, d) * 0.02)  # q_1..q_K
        self.fuse = nn.Linear(d + dt + d, d, bias=False)  # W_fuse, Eq. (2)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(layer_cfg, layer_idx=i) for i in range(config.num_layers)
        )
        num_shifts = config.num_layers - 1 if config.layer_shift else 0
        self.shifts = nn.ModuleList(nn.Linear(2 * d, d, bias=False) for _ in range(num_shifts))
        self.reset_shifts()
        self.rotary = LlamaRotaryEmbedding(layer_cfg)
        self.norm = LlamaRMSNorm(d, eps=eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.rank_head = RankHead(d, config.rank_hidden_size) if config.rank_head else None
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)

    # ---- vocabulary and embedding -------------------------------------------------------------

    def set_target_embedding(self, weight: torch.Tensor) -> None:  # [V_target, d_target]
        """Copy the target's token embedding in; it stays frozen (App. A.1)."""
        if weight.shape != self.embed_tokens.weight.shape:
            raise ValueError(
                f"target embedding shape {tuple(weight.shape)} != "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)
        self.embed_tokens.weight.requires_grad_(False)

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:  # [V_d] target id of each draft id
        """Install the draft->target id map (distinct target ids, one per draft id)."""
        cfg = self.config
        if d2t.shape != (cfg.draft_vocab_size,):
            raise ValueError(
                f"d2t must have shape ({cfg.draft_vocab_size},), got {tuple(d2t.shape)}"
            )
        if (
            d2t.min() < 0
            or d2t.max() >= cfg.target_vocab_size
            or d2t.unique().numel() != d2t.numel()
        ):
            raise ValueError("d2t must hold distinct target ids in [0, target_vocab_size)")
        self.d2t.copy_(d2t.long())

    # ---- forward ------------------------------------------------------------------------------

    def fuse_inputs(
        self,
        cond: torch.Tensor,  # [bs, S, 3*d_target] target features, or [bs, S, d] drafter state
        input_ids: torch.Tensor,  # [bs, S] start token (target ids)
        from_draft: bool,
    ) -> torch.Tensor:  # [bs, S, K, d]
        """``h^(0)_{t,k} = W_fuse[norm(c_t), norm(embed(x_t)), norm(q_k)]`` (Eqs. 1-2).

        Later blocks condition on the drafter's cached ``h^(L)`` and bypass ``W_cond`` (§3.2).
        With prefix broadcast (the default) every position gets ``c_t`` and ``embed(x_t)``;
        ablated (Table 2), only position 1 gets them and the others see their query alone.
        """
        d = self.config.hidden_size
        width = d if from_draft else 3 * self.config.target_hidden_size
        if cond.shape[-1] != width:
            raise ValueError(
                f"condition width {cond.shape[-1]} != {width} (from_draft={from_draft})"
            )
        w_cond, w_token, query = self._fuse_parts(cond.dtype)
        if serving_on_cpu(self, cond):  # the CPU serving path (one native call where built)
            return fused_inputs(self, cond, input_ids, from_draft, query)
        context = cond if from_draft else self.cond_proj(cond)
        token = self.embed_tokens(input_ids).to(context.dtype)
        prefix = F.linear(self.cond_norm(context), w_cond) + F.linear(
            self.token_norm(token), w_token
        )  # [bs, S, d]
        return with_queries(prefix, query, self.config.prefix_broadcast)

    def _fuse_parts(
        self, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [d, d], [d, dt], [K, d]
        """``W_fuse``'s condition and token columns, and the query term ``W_fuse[.., q_k]``.

        Training slices the parameter (autograd needs it). Without autograd the column blocks
        are kept contiguous (a strided weight costs a copy per GEMM) and the query term, which
        depends on no input, is computed once; both are rebuilt whenever a weight changes
        (in-place updates bump the version, ``.to()`` makes new tensors)."""
        d = self.config.hidden_size
        w = self.fuse.weight
        q = self.position_queries
        if torch.is_grad_enabled():
            query = F.linear(self.query_norm(q.to(dtype)), w[:, -d:])
            return w[:, :d], w[:, d:-d], query
        norm = self.query_norm.weight
        key = (
            dtype,
            w.data_ptr(),
            w._version,
            q.data_ptr(),
            q._version,
            norm.data_ptr(),
            norm._version,
        )
        cached = getattr(self, "_fuse_cache", None)
        if cached is None or cached[0] != key:
            query = F.linear(self.query_norm(q.to(dtype)), w[:, -d:])
            parts = (w[:, :d].contiguous(), w[:, d:-d].contiguous(), query)
            cached = (key, parts)
            self._fuse_cache = cached
        return cached[1]

    def rotary_embedding(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [bs, n, head_dim]
        """The rotary ``(cos, sin)`` of ``position_ids`` (``fast_layer.rotary_rows``: on the CPU
        without autograd, rows of a table the same module computed once)."""
        return rotary_rows(self, x, position_ids)

    def reset_shifts(self) -> None:
        """Start every ``W_shift`` at ``[I, 0]``: position k keeps its own state and takes
        nothing from k-1 until training asks for it.

        Eq. (3) replaces the residual stream between layers with this projection; PyTorch's
        default (random) init would scramble every position's state there, slot 1's included,
        and a short training run spends its budget undoing that: at 200 steps on the shipped
        target the randomly started shift drafted worse than no shift at all (held-out tau 1.61
        vs 2.51, ``benchmarks/RESULTS.md``).
        """
        d = self.config.hidden_size
        with torch.no_grad():
            for shift in self.shifts:
                shift.weight.zero_()
                shift.weight[:, :d].copy_(torch.eye(d, dtype=shift.weight.dtype))

    def layer_shift(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:  # [bs, S, K, d]
        """Eq. (3): ``W_shift^(l)[h_k, h_{k-1}]`` with ``h_0 = h_1``, inside each block."""
        previous = torch.cat([hidden[:, :, :1], hidden[:, :, :-1]], dim=2)
        return self.shifts[layer](torch.cat([hidden, previous], dim=-1))

    def forward(
        self,
        cond: torch.Tensor,  # [bs, S, 3*d_target] or [bs, S, d] (from_draft)
        input_ids: torch.Tensor,  # [bs, S]
        *,
        from_draft: bool = False,
        positions: torch.Tensor | None = None,  # [bs, S] position of each start token
        context_kv: ContextKV | KVWorkspace | None = None,  # per layer ([bs, n_kv, C, hd], same)
        attention_mask: torch.Tensor | None = None,  # [bs|1, S*K, C + S*K] bool
        heads: bool = True,
        propose: int = 0,
    ) -> BlockOutput:
        """Draft one block of K positions for each of ``S`` starts.

        Block slot ``k`` (0-based) of a start at position ``p`` takes rotary position
        ``p + 1 + k``, the position of the token it predicts. ``context_kv`` holds keys/values
        the caller cached (the prefix's block keys, on-path positions of earlier blocks;
        App. A.2), per layer or as a :class:`KVWorkspace` whose visible columns are the context
        (the block's keys go behind them); ``attention_mask`` defaults to
        :func:`block_attention_mask`, all context visible. ``heads=False`` skips the lm_head
        and rank head (``logits``, ``rank_logits`` None): a pass that only fills the context.
        ``propose`` > 0: each position's top ``propose`` candidates too, where the CPU serving
        path computes them with the heads (``fast_heads.served_heads``)."""
        bs, num_starts = input_ids.shape
        k, d = self.config.block_size, self.config.hidden_size
        hidden = self.fuse_inputs(cond, input_ids, from_draft)  # [bs, S, K, d]
        if positions is None:
            positions = torch.arange(num_starts, device=hidden.device).expand(bs, num_starts)
        slot = torch.arange(1, k + 1, device=hidden.device)
        position_ids = (positions[:, :, None] + slot).reshape(bs, num_starts * k)
        num_context = _num_context(context_kv)
        if attention_mask is None:
            attention_mask = block_attention_mask(k, num_starts, num_context, device=hidden.device)
        expected = (num_starts * k, num_context + num_starts * k)
        if tuple(attention_mask.shape[-2:]) != expected:
            raise ValueError(f"attention_mask must end in {expected}, got {attention_mask.shape}")
        mask = attention_mask.to(torch.bool).reshape(-1, 1, *expected)
        cache = _BlockCache(context_kv, len(self.layers))
        flat = hidden.reshape(bs, num_starts * k, d)
        flat, fast = self._run_layers(flat, mask, position_ids, cache, num_starts)
        hidden = flat.view(bs, num_starts, k, d)
        if not heads:
            return BlockOutput(None, None, hidden, cache.new)
        logits, rank_logits, proposal = served_heads(self, hidden, fast, propose)
        return BlockOutput(logits, rank_logits, hidden, cache.new, proposal)

    def _run_layers(
        self,
        flat: torch.Tensor,  # [bs, S*K, d]
        mask: torch.Tensor,  # [bs|1, 1, S*K, C + S*K] bool
        position_ids: torch.Tensor,  # [bs, S*K]
        cache: _BlockCache,
        num_starts: int,
    ) -> tuple[torch.Tensor, bool]:  # last layer's states; whether the CPU serving path ran
        bs, k, d = flat.shape[0], self.config.block_size, self.config.hidden_size
        table = rope_table(self, flat, position_ids)
        fast = table is not None and all(fast_path_ok(layer, flat) for layer in self.layers)
        # the CPU serving path (fast_layer.py) reads the table; the transformers layers (cos, sin)
        rope = None if fast else self.rotary_embedding(flat, position_ids)
        for i, layer in enumerate(self.layers):
            if i > 0 and self.config.layer_shift:
                flat = self.layer_shift(flat.view(bs, num_starts, k, d), i - 1).flatten(1, 2)
            if fast:  # same layer, native ops
                flat = fast_layer_forward(layer, flat, mask, position_ids, table[2], cache, i)
                continue
            flat = layer(
                flat,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                position_embeddings=rope,
            )
        return flat, fast

    def draft_block(
        self,
        cond: torch.Tensor,  # [bs, 3*d_target] target features at the prefix end, or [bs, d]
        input_ids: torch.Tensor,  # [bs] last verified token (or the start node's token)
        *,
        from_draft: bool = False,
        positions: torch.Tensor | None = None,  # [bs]
        context_kv: ContextKV | KVWorkspace | None = None,
        attention_mask: torch.Tensor | None = None,  # [bs|1, K, C + K] bool
    ) -> BlockOutput:
        """One block per start (Algorithm 2, line 5): outputs are ``[bs, K, ...]``.

        The first block conditions on the target's (low, mid, top) features; later blocks pass
        the cached ``h^(L)`` of their start position with ``from_draft=True``.
        """
        out = self.forward(
            cond[:, None],
            input_ids[:, None],
            from_draft=from_draft,
            positions=None if positions is None else positions[:, None],
            context_kv=context_kv,
            attention_mask=attention_mask,
        )
        rank = None if out.rank_logits is None else out.rank_logits[:, 0]
        return BlockOutput(out.logits[:, 0], rank, out.hidden[:, 0], out.kv)

    # ---- checkpoints --------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (embedding and ``d2t`` included)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> SpecBlockDrafter:
        """Load a drafter saved by :meth:`save_pretrained`; any defect raises
        :class:`CheckpointError` naming the file."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        root = Path(directory)
        config_path, weights_path = root / CONFIG_NAME, root / WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise CheckpointError(f"SpecBlock drafter checkpoint: missing file {path}")
        try:
            config = SpecBlockConfig.from_dict(json.loads(config_path.read_text()))
        except (ValueError, TypeError) as exc:
            raise CheckpointError(
                f"SpecBlock drafter checkpoint: bad {config_path}: {exc}"
            ) from exc
        try:
            state = load_file(str(weights_path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(
                f"SpecBlock drafter checkpoint: corrupt {weights_path}: {exc}"
            ) from exc
        model = cls(config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        shapes = [n for n in expected if n in state and state[n].shape != expected[n].shape]
        if missing or unexpected or shapes:
            raise CheckpointError(
                f"SpecBlock drafter checkpoint: {weights_path} does not match {config_path}: "
                f"missing={missing} unexpected={unexpected} wrong_shape={shapes}"
            )
        model.load_state_dict(state)
        model.embed_tokens.weight.requires_grad_(False)
        return model


def draft_vocab_from_counts(
    counts: torch.Tensor,  # [V_target] token frequencies in the training data
    draft_vocab_size: int,
) -> torch.Tensor:  # [V_d] d2t: target id of each draft id, most frequent first
    """Frequency-ranked reduced vocabulary (App. A.1, following EAGLE-3); ties by lower id."""
    if draft_vocab_size > counts.numel():
        raise ValueError(f"draft_vocab_size {draft_vocab_size} > vocabulary {counts.numel()}")
    order = torch.argsort(-counts.double(), stable=True)
    return order[:draft_vocab_size].long()
