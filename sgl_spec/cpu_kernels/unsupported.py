"""Ops that SGLang looks up at *import* time on a CPU host but that no dense Llama/Qwen3
model calls (vision, MoE routers, Qwen3.5 gating, ...).

Defining them lets those SGLang modules import; calling one raises an error that names the op,
so a model that really needs it fails loudly instead of computing something wrong.
"""

from __future__ import annotations

from sgl_spec.cpu_kernels.opdef import OpDef

IMPORT_TIME_ONLY = (
    "flash_attn_varlen_func",
    "conv3d_embed_cpu",
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_moe_router_cpu",
    "fused_dual_residual_rmsnorm_cpu",
    "fused_gdn_gating_cpu",
)


def _unsupported(name: str):
    def impl(*args: object) -> object:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by the sgl_spec CPU fallback; this model"
            " needs a native sgl_kernel CPU build"
        )

    return impl


OPS = [OpDef(name, "(Tensor[] args) -> Tensor", _unsupported(name)) for name in IMPORT_TIME_ONLY]
