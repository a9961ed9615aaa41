"""What our algorithms add under tensor parallelism, without a server: MTP_LORA's LoRA path cut
like the base layers it wraps (each rank's share of the delta equals the one-rank delta's
slice, or sums to it), and one controller setting per step across ranks (two gloo ranks whose
own controllers disagree both run rank 0's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from sgl_spec.control.controller import Decision
from sgl_spec.control.ranks import (
    RankZeroDecides,
    agreed_across_ranks,
    flag_agreed_across_ranks,
    rank_zero_flag,
)
from sgl_spec.mtp.sglang_lora import _Delta, _partial_sum, _rank_part
from tests.helpers.gloo import run_two_ranks

HIDDEN, RANK, HEAD = 8, 3, 2


def _group(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(rank_in_group=rank, world_size=size, all_reduce=lambda t: t)


def _factors(outs: list[int], in_dim: int = HIDDEN) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(sum(outs))
    return [(torch.randn(RANK, in_dim, generator=gen), torch.randn(o, RANK, generator=gen))
            for o in outs]  # fmt: skip


@pytest.mark.parametrize(("size", "kv_heads"), [(2, 2), (4, 2), (2, 1)])
def test_qkv_ranks_hold_their_heads_delta(size, kv_heads) -> None:
    """q heads split over the ranks; KV heads too, or replicated where ranks outnumber them."""
    q_heads = 4
    full = _factors([q_heads * HEAD, kv_heads * HEAD, kv_heads * HEAD])
    x = torch.randn(5, HIDDEN)
    per_part = [(x @ a.t()) @ b.t() for a, b in full]  # the one-rank delta of q, k and v
    replicas = max(size // kv_heads, 1)
    kv_per_rank = max(kv_heads // size, 1) * HEAD
    for rank in range(size):
        module = SimpleNamespace(
            tp_group=_group(rank, size), input_size_per_partition=HIDDEN,
            output_partition_sizes=[q_heads * HEAD // size, kv_per_rank, kv_per_rank],
            num_kv_head_replicas=replicas,
        )  # fmt: skip
        parts = zip(("q_proj", "k_proj", "v_proj"), full, strict=True)
        mine = [_rank_part(module, "self_attn.qkv_proj", p, a, b) for p, (a, b) in parts]
        got = _Delta(mine, 1.0, torch.float32)(x)
        q_width = q_heads * HEAD // size
        q = per_part[0][:, rank * q_width : (rank + 1) * q_width]
        kv = rank // replicas
        k, v = (d[:, kv * kv_per_rank : (kv + 1) * kv_per_rank] for d in per_part[1:])
        torch.testing.assert_close(got, torch.cat([q, k, v], dim=1))


@pytest.mark.parametrize("reduces", [True, False])
def test_row_parallel_partial_deltas_sum_to_the_delta(reduces) -> None:
    """o_proj / down_proj: each rank's input shard gives a partial ``x Aᵀ``; summed over the
    ranks (by the all-reduce before ``B``, or by the base layer's later collective) they give
    the one-rank delta."""
    size, out = 2, 6
    (a, b), x = _factors([out])[0], torch.randn(4, HIDDEN)
    expected = (x @ a.t()) @ b.t()
    total = torch.zeros_like(expected)
    for rank in range(size):
        width = HIDDEN // size
        module = SimpleNamespace(
            tp_group=_group(rank, size), input_size_per_partition=width, input_is_parallel=True,
            reduce_results=reduces, output_partition_sizes=[out],
        )  # fmt: skip
        reduce = _partial_sum(module)
        assert (reduce is not None) == reduces
        mine = _rank_part(module, "self_attn.o_proj", "o_proj", a, b)
        total += _Delta([mine], 1.0, torch.float32)(x[:, rank * width : (rank + 1) * width])
    torch.testing.assert_close(total, expected)


def test_one_rank_keeps_the_factors_and_the_controller() -> None:
    a, b = _factors([4])[0]
    module = SimpleNamespace(tp_group=None, input_size_per_partition=HIDDEN)
    assert _rank_part(module, "mlp.down_proj", "down_proj", a, b) == (a, b)
    assert _partial_sum(module) is None
    controller = object()
    assert agreed_across_ranks(controller) is controller  # no tensor-parallel group here
    assert agreed_across_ranks(None) is None


class _OwnMind:
    """A controller that chooses its rank's number + 1 and records what it was asked."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.observed: list[int] = []

    def decide(self, batch_size: int, ctx_len: int) -> Decision:
        return Decision(self.rank + 1, 1.0, 1, 1.0, 1.0, source="measured")

    def predict(self, k: int, batch_size: int, ctx_len: int) -> Decision:
        return Decision(k, 2.0, k + 1, 1.0, 1.0, source="measured")

    def observe(self, k: int, accepted: list[int]) -> None:
        self.observed.append(k)


def _agree(rank: int, store_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        group = SimpleNamespace(first_rank=0, cpu_group=dist.group.WORLD)
        controller = RankZeroDecides(_OwnMind(rank), group)
        decisions = [controller.decide(4, 100) for _ in range(3)]
        controller.observe(decisions[0].k, [1])  # everything else reaches the rank's own
        results[rank] = ([(d.k, d.source) for d in decisions], controller.observed)
    finally:
        dist.destroy_process_group()


def test_every_rank_runs_rank_zeros_setting() -> None:
    results = run_two_ranks(_agree)
    assert results[0] == ([(1, "measured")] * 3, [1])
    assert results[1] == ([(1, "rank 0")] * 3, [1])


def _flag(rank: int, store_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        agree = rank_zero_flag(SimpleNamespace(first_rank=0, cpu_group=dist.group.WORLD))
        results[rank] = [agree(rank == 0), agree(rank == 1)]
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_zeros_flag() -> None:
    """The n-gram branch's choice to skip the drafter, made from each rank's own step times."""
    assert flag_agreed_across_ranks() is None  # no tensor-parallel group here
    assert run_two_ranks(_flag) == {0: [True, False], 1: [True, False]}
