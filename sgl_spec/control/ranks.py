"""One setting per step across tensor-parallel ranks.

Every rank of a tensor-parallel group runs the same speculative step on its shard: the number
of drafts or tree nodes must be the same on all of them, or their collectives would not meet.
Each rank's controller sees the same acceptance but times its own steps, so their choices can
differ; ``RankZeroDecides`` makes every rank run the setting rank 0's controller chose (one
broadcast of an integer per decode step over the group's CPU channel). Every rank still feeds
its own controller what it ran and how long it took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch


class RankZeroDecides:
    """A controller whose ``decide`` returns tensor-parallel rank 0's setting on every rank;
    everything else is the wrapped controller's."""

    def __init__(self, controller: Any, group: Any) -> None:
        self._controller = controller
        self._group = group  # SGLang's GroupCoordinator of the tensor-parallel ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._controller, name)

    def decide(self, batch_size: int, ctx_len: int) -> Any:
        local = self._controller.decide(batch_size, ctx_len)
        k = rank_zero_value(self._group, local.k)
        if k == local.k:
            return local
        return replace(self._controller.predict(k, batch_size, ctx_len), source="rank 0")


def rank_zero_value(group: Any, value: int) -> int:
    """Rank 0's ``value`` on every rank of ``group`` (one broadcast over its CPU channel)."""
    chosen = torch.tensor([value], dtype=torch.int64)
    torch.distributed.broadcast(chosen, src=group.first_rank, group=group.cpu_group)
    return int(chosen.item())


def rank_zero_flag(group: Any) -> Callable[[bool], bool]:
    """A per-step yes/no that every rank of ``group`` takes from rank 0: for choices made
    from each rank's own step times."""
    return lambda value: bool(rank_zero_value(group, int(value)))


def flag_agreed_across_ranks() -> Callable[[bool], bool] | None:
    """``rank_zero_flag`` of this process's tensor-parallel group; None with one rank."""
    group = tensor_parallel_group()
    return None if group is None else rank_zero_flag(group)


def tensor_parallel_group() -> Any:
    """SGLang's tensor-parallel GroupCoordinator of this process when it has two ranks or more,
    else None (one rank, or a process outside SGLang's workers)."""
    from sglang.srt.distributed.parallel_state import get_parallel

    try:
        group = get_parallel().tp_group
    except RuntimeError:  # no tensor-parallel group: a process outside SGLang's workers
        return None
    return group if group.world_size > 1 else None


def agreed_across_ranks(controller: Any) -> Any:
    """``controller`` itself where this process is its tensor-parallel group's only rank (or
    there is no controller); else wrapped so that rank 0 decides for all."""
    group = None if controller is None else tensor_parallel_group()
    return controller if group is None else RankZeroDecides(controller, group)
