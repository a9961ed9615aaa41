"""Tensor-parallel collectives of SGLang's CPU engine, under ``sgl_kernel``'s names and schemas.

A CPU build of ``sgl_kernel`` implements them over shared memory between the ranks of one host;
SGLang calls them for a CPU tensor whenever ``is_shm_available`` holds (it does wherever the
fallback stands in, since the fallback defines the ops that mark the CPU kernels available).
Here they are ``torch.distributed`` collectives over the tensor-parallel group SGLang already
set up (gloo on CPU): the same sums and concatenations, without the shared-memory shortcut.
Like the upstream ops they serve that one group, sized by ``initialize``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sgl_spec.cpu_kernels.opdef import OpDef

_WORLD: dict[str, int] = {}

# upstream's reduce_op argument is an int(torch.distributed.ReduceOp.<op>)
_REDUCE_OPS = {
    int(op): op
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX)
}


def initialize(size: int, rank: int) -> None:
    """Called once per rank by SGLang's CPU bootstrap with the tensor-parallel size and rank."""
    _WORLD.update(size=size, rank=rank)


def _group():
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if "size" in _WORLD and group.world_size != _WORLD["size"]:
        raise RuntimeError(
            f"sgl_spec collectives: initialized for {_WORLD['size']} ranks, the tensor-parallel"
            f" group has {group.world_size}"
        )
    return group.device_group


def shm_allreduce(data: torch.Tensor, reduce_op: int) -> None:
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"shm_allreduce: unsupported reduce_op {reduce_op}")
    dist.all_reduce(data, op=_REDUCE_OPS[reduce_op], group=_group())


def shm_allgather(data: torch.Tensor, dim: int) -> torch.Tensor:
    group = _group()
    parts = [torch.empty_like(data) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, data.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


OPS = [
    OpDef("shm_allreduce", "(Tensor(a!) data, int reduce_op) -> ()", shm_allreduce),
    OpDef("shm_allgather", "(Tensor data, int dim) -> Tensor", shm_allgather),
]
