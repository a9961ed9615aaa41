"""Gated LoRA inside SGLang's own target model (paper §4.3: Y = XW + (g ⊙ X)ABᵀ).

The MTP_LORA worker runs one target forward per step in which anchors (gate 0) verify and mask
tokens (gate 1) draft. SGLang's Llama/Qwen3 layers fuse projections (``qkv_proj`` = q|k|v,
``gate_up_proj`` = gate|up), so each wrapped module adds the concatenation of the per-projection
LoRA deltas, and only on the gated rows: the rows of anchors are never touched, which keeps the
verifier bit-identical to the base model. Mask tokens get the adapter's own embeddings (the
shipped target ties its embedding to the LM head, so base rows must stay as they are).

The gate is per forward: the worker sets it with ``GatedLoRA.gates(width, first_gated, ...)`` around
the forward; outside that context every wrapped module is the base module. The layer shapes the
wrappers rely on are checked at start-up with the patches (``patches/spec_internals.py``).

Under tensor parallelism each rank holds its shard of the LoRA path, cut like the base layer it
wraps: a column-parallel module (``qkv_proj``, ``gate_up_proj``) keeps the rows of ``B`` for its
output shard (q, k and v heads, gate and up columns, KV heads replicated where the ranks
outnumber them); a row-parallel one (``o_proj``, ``down_proj``) keeps the columns of ``A`` for its
input shard, so ``x Aᵀ`` is a partial sum: all-reduced before ``B`` where the base layer reduces
its output itself, added to the partial output where a later collective reduces both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from sglang.srt.distributed.utils import get_group_rank_size
from torch import nn

from sgl_spec.cpu_kernels import native
from sgl_spec.patches import cpu_packed_linear as cpu_linear

# SGLang fused module -> the HF projections it concatenates, in output order.
FUSED_MODULES = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class _Gate:
    """Which rows of a forward take the LoRA path.

    The flat token rows come in blocks of ``width`` (one block per request, the step layout of
    ``sgl_spec/mtp/layout.py``); in every block the rows from ``first_gated`` on are mask tokens.
    Describing the gate by this pattern instead of a row list lets every wrapped module read and
    update the gated rows through strided views, without index gathers and scatters."""

    width: int = 0
    first_gated: int = 0
    mask_index: torch.Tensor | None = None  # [width - first_gated] mask embedding, 0-based

    @property
    def active(self) -> bool:
        return self.width > self.first_gated


class _Delta(nn.Module):
    """LoRA factors of one fused module as two matrices: ``A`` stacks the parts' down
    projections, ``B`` is block-diagonal, so the concatenated delta is ``(x Aᵀ) Bᵀ`` -- two
    matmuls per module instead of two per part and a concatenation."""

    def __init__(
        self,
        factors: list[tuple[torch.Tensor, torch.Tensor]],
        scaling: float,
        dtype: torch.dtype,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.reduce = reduce  # all-reduce of the rank-wide partial sums (row-parallel, tp > 1)
        a = torch.cat([a for a, _ in factors], dim=0)  # [sum(rank), in]
        b = torch.block_diag(*[b for _, b in factors]) * scaling  # [sum(out), sum(rank)]
        self.a = nn.Parameter(a.to(dtype), requires_grad=False)
        self.b = nn.Parameter(b.to(dtype), requires_grad=False)
        # float32 on a CPU with our native kernel: both factors packed like the base layers and
        # multiplied by the patch's own path (``patches/cpu_packed_linear.py``), whose kernel
        # beats ``torch.matmul`` at these rows; elsewhere ``packed_linear`` declines, a matmul
        self._factors = (SimpleNamespace(weight=self.a), SimpleNamespace(weight=self.b))
        # and the whole gated delta in one native call where the library has it (a float32
        # CPU forward without a partial sum to reduce): Bᵀ laid out for it once
        self._fused: Callable | None = None
        if cpu_linear.kind() == "native" and cpu_linear.available("native"):
            for factor in self._factors:
                cpu_linear.pack(factor, "native")
            ops = native.ops()
            if reduce is None and dtype == torch.float32 and hasattr(ops, "gated_lora_add"):
                self._fused = ops.gated_lora_add
                self.register_buffer("bt", self.b.detach().t().contiguous(), persistent=False)
                # the output columns each rank row of the block-diagonal B reaches
                self.register_buffer("spans", _block_spans(factors), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, in] -> [n, sum(out)]
        low = self._matmul(x.to(self.a.dtype), 0)
        if self.reduce is not None:
            low = self.reduce(low)
        return self._matmul(low, 1)

    def add_gated(self, x: torch.Tensor, out: torch.Tensor, width: int, first_gated: int) -> bool:
        """``out``'s gated rows += their delta in one native call; False where it cannot run
        (then the caller takes the PyTorch path)."""
        if (
            self._fused is None
            or x.dim() != 2
            or out.dim() != 2
            or x.dtype != torch.float32
            or out.dtype != torch.float32
            or x.stride(1) != 1
            or out.stride(1) != 1
        ):
            return False
        self._fused(x, out, self.a, self.bt, self.spans, width, first_gated)
        return True

    def _matmul(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """``x @ factor.T`` for factor ``a`` (0) or ``b`` (1)."""
        factor = self._factors[which]
        out = cpu_linear.packed_linear(factor, x, None)
        return x @ factor.weight.t() if out is None else out


def _block_spans(factors: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[sum(rank), 2] int64: for each row of the stacked ``A``, the range of the concatenated
    outputs its part's ``B`` writes (the non-zero columns of that row of ``Bᵀ``)."""
    spans, start = [], 0
    for a, b in factors:
        spans += [(start, start + b.shape[0])] * a.shape[0]
        start += b.shape[0]
    return torch.tensor(spans, dtype=torch.int64).reshape(-1, 2)


class GatedLoRA:
    """Installed adapter: holds the gate and the deltas; ``gates()`` activates them."""

    def __init__(self, mask_embeddings: torch.Tensor, k_max: int) -> None:
        self.mask_embeddings = mask_embeddings  # [k_max, hidden]
        self.k_max = k_max
        self._gate = _Gate()
        self.deltas: dict[str, _Delta] = {}

    @contextlib.contextmanager
    def gates(self, width: int, first_gated: int, mask_index: torch.Tensor) -> Iterator[None]:
        """Gate rows ``first_gated..width-1`` of every block of ``width`` flat rows.

        mask_index: [width - first_gated] which mask embedding each gated row of a block gets.
        A compiled verify (``--enable-torch-compile``) holds the gate it was captured under
        (``MtpLoraWorker.compiled_state``), unguarded: a verify of (k+1)² tokens a request must
        always run under ``gates((k+1)², k+1, <k's mask index>)``."""
        if not 0 <= first_gated <= width or mask_index.shape != (width - first_gated,):
            raise ValueError(
                f"gates: need 0 <= first_gated <= width and one mask index per gated row; got "
                f"{width=}, {first_gated=}, mask_index of shape {tuple(mask_index.shape)}"
            )
        self._gate = _Gate(width, first_gated, mask_index)
        try:
            yield
        finally:
            self._gate = _Gate()

    def _gated_view(self, t: torch.Tensor) -> torch.Tensor:
        """[n, d] -> [n / width, width - first_gated, d] view of the gated rows."""
        gate = self._gate
        if t.shape[0] % gate.width:
            raise RuntimeError(
                f"MTP_LORA: {t.shape[0]} rows do not split into steps of width {gate.width}"
            )
        return t.view(-1, gate.width, t.shape[-1])[:, gate.first_gated :]

    def _add_delta(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        gate = self._gate
        if not gate.active:
            return out
        delta_module = self.deltas[name]
        if delta_module.add_gated(x, out, gate.width, gate.first_gated):
            return out
        gated_x = self._gated_view(x)
        delta = delta_module(gated_x.reshape(-1, x.shape[-1]))
        # In place: ``out`` is the base projection's fresh output; anchor rows are untouched.
        self._gated_view(out).add_(delta.view(gated_x.shape[0], gated_x.shape[1], -1).to(out.dtype))
        return out

    def _embed(self, out: torch.Tensor) -> torch.Tensor:
        if not self._gate.active:
            return out
        emb = self.mask_embeddings.index_select(0, self._gate.mask_index).to(out.dtype)
        self._gated_view(out).copy_(emb.expand(out.shape[0] // self._gate.width, -1, -1))
        return out


def _wrap_linear(module: nn.Module, adapter: GatedLoRA, name: str) -> None:
    base_forward = module.forward

    def forward(x: torch.Tensor, *args, **kwargs):
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
    # Half-precision matmuls of this size are slow on CPUs; the masks' path only drafts, so its
    # precision never affects what is emitted.
    delta_dtype = torch.float32 if device.type == "cpu" else dtype
    scaling = config.alpha / config.rank
    for i, layer in enumerate(layers):
        for fused, parts in FUSED_MODULES.items():
            owner, attr = fused.split(".")
            target = getattr(getattr(layer, owner), attr)
            factors = []
            for part in parts:
                if part in config.target_modules:
                    lora = loaded.lora(i, part)
                    a, b = _rank_part(
                        target, fused, part, lora.lora_A.detach(), lora.lora_B.detach()
                    )
                else:  # a projection the adapter leaves alone: zero delta
                    a = torch.zeros(config.rank, _in_dim(target))
                    b = torch.zeros(_out_sizes(target, len(parts))[parts.index(part)], config.rank)
                factors.append((a.to(device, torch.float32), b.to(device, torch.float32)))
            _check_shapes(target, fused, parts, factors)
            name = f"{i}.{fused}"
            adapter.deltas[name] = _Delta(factors, scaling, delta_dtype, _partial_sum(target))
            _wrap_linear(target, adapter, name)
        dual = getattr(layer.mlp, "dual_gemm", None)
        if dual is not None:
            _gate_dual_gemm(dual, adapter)
    _wrap_embedding(inner.embed_tokens, adapter)
    return adapter


def _gate_dual_gemm(dual: object, adapter: GatedLoRA) -> None:
    """SGLang's fused gate/up + activation kernel (CUDA, small decode batches) bypasses
    ``gate_up_proj``'s forward, so it must not run while mask rows need their LoRA delta; steps
    without gated rows (the anchors only, e.g. k = 0) keep it."""
    base_can_run = dual.can_run

    def can_run(*args, **kwargs) -> bool:
        return not adapter._gate.active and base_can_run(*args, **kwargs)

    dual.can_run = can_run


def _rank_part(
    module: nn.Module, fused: str, part: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slice of one projection's full LoRA factors that this rank's shard of ``module``
    needs (the factors themselves with one rank)."""
    rank, size = get_group_rank_size(getattr(module, "tp_group", None))
    if size == 1:
        return a, b
    if fused in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: input columns
        width = _in_dim(module)
        return a[:, rank * width : (rank + 1) * width], b
    parts = FUSED_MODULES[fused]
    rows = _out_sizes(module, len(parts))[parts.index(part)]
    shard = rank
    if part in ("k_proj", "v_proj"):  # KV heads are replicated where ranks outnumber them
        shard = rank // int(getattr(module, "num_kv_head_replicas", 1) or 1)
    return a, b[shard * rows : (shard + 1) * rows]


def _partial_sum(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A row-parallel layer that all-reduces its own output gets a delta from every rank's
    input shard: its rank-wide ``x Aᵀ`` is summed over the ranks first."""
    group = getattr(module, "tp_group", None)
    _, size = get_group_rank_size(group)
    if size == 1 or not getattr(module, "input_is_parallel", False):
        return None
    if not getattr(module, "reduce_results", False):
        return None  # the partial delta joins the partial output; a later collective sums both
    if not hasattr(group, "all_reduce"):
        raise ValueError(f"MTP_LORA: cannot all-reduce over {type(group).__name__}")
    return group.all_reduce


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
