"""Dense-layer ops SGLang's CPU engine calls once ``cpu_has_amx_support()`` is true.

SGLang decides "the CPU kernels are available" by the presence of
``torch.ops.sgl_kernel.convert_weight_packed``; only then may ``--attention-backend intel_amx``
(needed for speculative decoding on CPU) be used, and from then on layers call these ops
instead of their ``forward_native`` paths. Each one below computes what the native path
computes. Weight "packing" is the identity: the packed layout is private to
``weight_packed_linear``, which here is a plain ``F.linear``. Float32 RMSNorm, SiLU-and-mul,
neox RoPE and KV row stores go to the native kernels where they are built (``native.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_spec.cpu_kernels import collectives, native
from sgl_spec.cpu_kernels.memo import LastCall
from sgl_spec.cpu_kernels.opdef import OpDef

F32 = torch.float32


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # one fused ATen call instead of five element-wise ops (per-op overhead dominates at
        # decode sizes); the same float32 arithmetic row by row
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = native.ops()
    if ops is not None and input.dtype == F32 and weight.dtype == F32:
        return ops.rmsnorm(input, weight, eps)
    return _rms(input, weight, eps)


def fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """residual <- input + residual; input <- rmsnorm(residual) (both in place)."""
    ops = native.ops()
    if (
        ops is not None
        and input.dtype == F32
        and residual.dtype == F32
        and weight.dtype == F32
        and input.is_contiguous()
        and residual.is_contiguous()
    ):
        ops.fused_add_rmsnorm(input, residual, weight, eps)
        return
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps))


def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    ops = native.ops()
    if ops is not None and input.dtype == F32 and input.dim() >= 1 and input.stride(-1) == 1:
        return ops.silu_and_mul(input)  # one call in place of four ATen ops
    gate, up = input.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_and_mul(input: torch.Tensor) -> torch.Tensor:
    gate, up = input.chunk(2, dim=-1)
    return F.gelu(gate) * up


def gelu_tanh_and_mul(input: torch.Tensor) -> torch.Tensor:
    gate, up = input.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [tokens, heads, rotary_dim]; cos/sin: [tokens, 1, rotary_dim // 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


_COS_SIN: LastCall[tuple[torch.Tensor, torch.Tensor]] = LastCall()


def _neox_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, 1, rotary_dim]`` cos and sign-folded sin of a neox rotation, built once per
    forward (``memo``): ``x * cos + swap_halves(x) * sin`` is then the whole rotation."""

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin_cache.index_select(0, positions).to(dtype).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]

    return _COS_SIN.get((positions,), (cos_sin_cache,), (dtype,), build)


def _rows_layout(x: torch.Tensor, head_size: int) -> bool:
    """``x`` is [tokens, width] or [tokens, heads, head_size] with unit inner stride and heads
    packed within a token (what the native RoPE reads)."""
    if x.dim() == 2:
        return x.stride(1) == 1
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == head_size


def rotary_embedding(
    positions: torch.Tensor,  # [tokens]
    query: torch.Tensor,  # [tokens, heads * head_size] or [tokens, heads, head_size]
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim] = cos half | sin half
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    rotary_dim = cos_sin_cache.shape[-1]
    ops = native.ops()
    if (
        ops is not None
        and is_neox
        and rotary_dim == head_size
        and query.dtype == key.dtype == cos_sin_cache.dtype == F32
        and _rows_layout(query, head_size)
        and _rows_layout(key, head_size)
    ):
        return ops.rope_neox(positions, query, key, head_size, cos_sin_cache)
    if is_neox and rotary_dim == head_size:
        # the common case in four element-wise ops per tensor; each element gets the same
        # float operations as in _rotate (a - b == a + (-b) exactly)
        cos, sin = _neox_cos_sin(positions, cos_sin_cache, query.dtype)
        half = head_size // 2
        outputs = []
        for x in (query, key):
            xv = x.reshape(num_tokens, -1, head_size)
            swapped = torch.cat((xv[..., half:], xv[..., :half]), dim=-1)
            outputs.append((xv * cos + swapped * sin).reshape(x.shape))
        return outputs[0], outputs[1]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos = cos.unsqueeze(-2).to(query.dtype)
    sin = sin.unsqueeze(-2).to(query.dtype)
    outputs = []
    for x in (query, key):
        shape = x.shape
        xv = x.reshape(num_tokens, -1, head_size)
        rot = _rotate(xv[..., :rotary_dim], cos, sin, is_neox)
        outputs.append(torch.cat((rot, xv[..., rotary_dim:]), dim=-1).reshape(shape))
    return outputs[0], outputs[1]


def apply_rotary_pos_emb(
    q: torch.Tensor,  # [tokens, heads, head_size]
    k: torch.Tensor,  # [tokens, kv_heads, head_size]
    cos: torch.Tensor,  # [tokens, head_size]
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style rotate-half RoPE, computed in float32 like SGLang's native version."""
    cos = cos.unsqueeze(unsqueeze_dim).float()
    sin = sin.unsqueeze(unsqueeze_dim).float()
    outputs = []
    for x in (q, k):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        outputs.append((xf * cos + rotated * sin).to(x.dtype))
    return outputs[0], outputs[1]


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    return weight


def weight_packed_linear(
    mat1: torch.Tensor, mat2: torch.Tensor, bias: torch.Tensor | None, is_vnni: bool
) -> torch.Tensor:
    return F.linear(mat1, mat2.to(mat1.dtype), None if bias is None else bias.to(mat1.dtype))


def store_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    row_dim: int,
) -> None:
    ops = native.ops()
    if ops is not None and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == F32:
        ks, vs = k.reshape(-1, row_dim), v.reshape(-1, row_dim)
        if (
            ks.stride(1) == 1
            and vs.stride(1) == 1
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        ):
            ops.store_rows(ks, k_cache, indices)
            ops.store_rows(vs, v_cache, indices)
            return
    idx = indices.long()
    k_cache.view(-1, row_dim)[idx] = k.reshape(-1, row_dim).to(k_cache.dtype)
    v_cache.view(-1, row_dim)[idx] = v.reshape(-1, row_dim).to(v_cache.dtype)


def init_cpu_threads_env(cpu_ids: str) -> str:
    """Bind this process's torch threads to ``cpu_ids`` ("0-3,6"); returns a description."""
    import os

    cores: list[int] = []
    spec = cpu_ids.strip().strip("[]").replace(" ", "")
    if spec in ("", "all"):
        spec = ""
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    return f"sgl_spec fallback: {len(cores) or torch.get_num_threads()} threads on cores {cpu_ids}"


OPS = [
    OpDef("rmsnorm_cpu", "(Tensor input, Tensor weight, float eps) -> Tensor", rmsnorm),
    OpDef(
        "fused_add_rmsnorm_cpu",
        "(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        fused_add_rmsnorm,
    ),
    OpDef("silu_and_mul_cpu", "(Tensor input) -> Tensor", silu_and_mul),
    OpDef("gelu_and_mul_cpu", "(Tensor input) -> Tensor", gelu_and_mul),
    OpDef("gelu_tanh_and_mul_cpu", "(Tensor input) -> Tensor", gelu_tanh_and_mul),
    OpDef(
        "rotary_embedding_cpu",
        "(Tensor positions, Tensor query, Tensor key, int head_size, Tensor cos_sin_cache,"
        " bool is_neox) -> (Tensor, Tensor)",
        rotary_embedding,
    ),
    OpDef(
        "apply_rotary_pos_emb_cpu",
        "(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> (Tensor, Tensor)",
        apply_rotary_pos_emb,
    ),
    OpDef("convert_weight_packed", "(Tensor weight) -> Tensor", convert_weight_packed),
    OpDef(
        "weight_packed_linear",
        "(Tensor mat1, Tensor mat2, Tensor? bias, bool is_vnni) -> Tensor",
        weight_packed_linear,
    ),
    OpDef(
        "store_cache_cpu",
        "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor indices,"
        " int row_dim) -> ()",
        store_cache,
    ),
]

# Ops without a tensor argument dispatch through CompositeExplicitAutograd (see registry).
NO_TENSOR_OPS = [
    OpDef("init_cpu_threads_env", "(str cpu_ids) -> str", init_cpu_threads_env),
    OpDef("initialize", "(int size, int rank) -> ()", collectives.initialize),
]
