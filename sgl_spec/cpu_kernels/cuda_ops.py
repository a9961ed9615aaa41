"""PyTorch versions of the ``sgl_kernel`` ops SGLang's CUDA path calls, for a GPU host where the
compiled library cannot load (e.g. sglang-kernel 0.4.10, built against torch 2.14, on torch 2.11).

Registered only in that case (``boot.py``), for every device (``CompositeExplicitAutograd``),
with the upstream schemas the Python wrappers in ``sgl_kernel.elementwise`` call. With the
launcher's defaults for such a host (``launch_server.apply_cuda_fallback_defaults``: SGLang's
torch-native fused ops, the PyTorch sampling backend, the triton attention backend) SGLang
0.5.23 reaches none of the three layer ops for a dense Llama/Qwen3 model; they keep a call that
does get through correct instead of failing on a missing op. ``weak_ref_tensor`` is what CUDA
graph capture needs (SGLang's breakable graphs and piecewise backends hand out non-owning views
of graph-pool memory). Not provided, because those settings avoid them: ``top_k_renorm_probs``
/ ``top_p_renorm_probs`` (the flashinfer sampling backend).
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


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory that does not own it (the compiled op's ``from_blob``):
    same device, dtype, sizes and strides; it keeps nothing alive, so it is valid only while
    the memory's owner (a CUDA graph's pool, for SGLang) is."""
    extent = 0
    if tensor.numel() > 0:
        extent = 1 + sum(
            (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
        )
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.data_ptr(), tensor.device, extent * tensor.element_size()
    )
    out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return out.set_(storage, 0, tensor.shape, tensor.stride())


# one op a line: name, sgl_kernel's schema, the PyTorch implementation
OPS = [
    OpDef("rmsnorm", "(Tensor(a!) output, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()", rmsnorm),
    OpDef("fused_add_rmsnorm", "(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, bool enable_pdl) -> ()", fused_add_rmsnorm),
    OpDef("silu_and_mul", "(Tensor(a!) out, Tensor input) -> ()", silu_and_mul),
    OpDef("weak_ref_tensor", "(Tensor tensor) -> Tensor", weak_ref_tensor),
]  # fmt: skip
