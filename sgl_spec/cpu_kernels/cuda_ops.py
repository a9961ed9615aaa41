"""PyTorch versions of the ``sgl_kernel`` ops SGLang's CUDA path calls, for a GPU host where the
compiled library cannot load (e.g. sglang-kernel 0.4.10, built against torch 2.14, on torch 2.11).

Registered only in that case (``boot.py``), for every device (``CompositeExplicitAutograd``),
with the upstream schemas the Python wrappers in ``sgl_kernel.elementwise`` call. With the
launcher's defaults for such a host (``launch_server.apply_cuda_fallback_defaults``: SGLang's
torch-native fused ops, the PyTorch sampling backend, the triton attention backend, no CUDA
graphs) SGLang 0.5.23 reaches none of them for a dense Llama/Qwen3 model; they keep a call that
does get through correct instead of failing on a missing op. Not provided, because those
settings avoid them: ``weak_ref_tensor`` (CUDA-graph capture) and ``top_k_renorm_probs`` /
``top_p_renorm_probs`` (the flashinfer sampling backend).
"""

from __future__ import annotations

import torch

from sgl_spec.cpu_kernels import layers
from sgl_spec.cpu_kernels.opdef import OpDef


def rmsnorm(
    output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float, enable_pdl: bool
) -> None:
    """``output = input / rms(input) * weight`` (fp32 inside), written into ``output``."""
    output.copy_(layers.rmsnorm(input, weight, eps))


def fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, enable_pdl: bool
) -> None:
    """``residual += input`` then ``input = rmsnorm(residual) * weight``, both in place."""
    layers.fused_add_rmsnorm(input, residual, weight, eps)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``out = silu(x[..., :d]) * x[..., d:]`` (fp32 inside, as the CUDA kernel) for ``input``
    of last dimension ``2d``."""
    out.copy_(layers.silu_and_mul(input.float()))


OPS = [
    OpDef(
        "rmsnorm",
        "(Tensor(a!) output, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()",
        rmsnorm,
    ),
    OpDef(
        "fused_add_rmsnorm",
        "(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, bool enable_pdl) -> ()",
        fused_add_rmsnorm,
    ),
    OpDef("silu_and_mul", "(Tensor(a!) out, Tensor input) -> ()", silu_and_mul),
]
