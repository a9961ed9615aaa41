"""Tensor parallelism on the CPU engine: the fallback's collectives
(``cpu_kernels/collectives.py``) over two gloo ranks, called through ``torch.ops.sgl_kernel``
as SGLang's CPU engine calls them, equal to the sums and concatenations they stand for; the
patch that keeps NCCL out of gloo groups; the launcher's core lists per rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sgl_spec.cpu_kernels import collectives, registry
from tests.helpers.gloo import run_two_ranks


def _rank(rank: int, store_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        registry.register()
        collectives._group = lambda: dist.group.WORLD  # SGLang's TP group is the world here
        torch.ops.sgl_kernel.initialize(2, rank)
        data = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
        torch.ops.sgl_kernel.shm_allreduce(data, int(dist.ReduceOp.SUM))
        gathered = torch.ops.sgl_kernel.shm_allgather(torch.full((2, 1), float(rank)), 1)
        results[rank] = (data, gathered)
    finally:
        dist.destroy_process_group()


def test_allreduce_and_allgather_over_two_ranks() -> None:
    results = run_two_ranks(_rank)
    expected = torch.arange(6, dtype=torch.float32).reshape(2, 3) * 3
    for rank in range(2):
        data, gathered = results[rank]
        assert torch.equal(data, expected)
        assert torch.equal(gathered, torch.tensor([[0.0, 1.0], [0.0, 1.0]]))


def test_upstream_schemas() -> None:
    schemas = {op.name: op.schema for op in collectives.OPS}
    assert schemas == {
        "shm_allreduce": "(Tensor(a!) data, int reduce_op) -> ()",
        "shm_allgather": "(Tensor data, int dim) -> Tensor",
    }
    with pytest.raises(ValueError, match="reduce_op"):
        collectives.shm_allreduce(torch.zeros(1), 99)


def test_gloo_groups_build_no_nccl_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    """``patches/cpu_tensor_parallel``: a gloo group whose caller left ``use_pynccl`` unset gets
    False; NCCL groups and explicit choices pass through unchanged."""
    import importlib

    from sgl_spec.patches import cpu_tensor_parallel as patch

    module = importlib.import_module(patch.TARGET)
    calls = []

    def fake(group_ranks, local_rank, backend, use_pynccl=None, **kwargs):
        calls.append((backend, use_pynccl))

    monkeypatch.setattr(module, "init_model_parallel_group", fake)
    assert patch.apply() and not patch.apply()  # idempotent
    module.init_model_parallel_group([[0, 1]], 0, "gloo", group_name="tp")
    module.init_model_parallel_group([[0, 1]], 0, "nccl", group_name="tp")
    module.init_model_parallel_group([[0, 1]], 0, "gloo", use_pynccl=True)
    assert calls == [("gloo", False), ("nccl", None), ("gloo", True)]


def test_launcher_gives_each_rank_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """More ranks than NUMA nodes and no ``SGLANG_CPU_OMP_THREADS_BIND``: the launcher splits
    its cores into one contiguous list per rank; a user's setting is kept."""
    import sglang.srt.utils.common as common

    from sgl_spec import algorithms

    monkeypatch.setattr(common, "get_cpu_ids_by_node", lambda: [list(range(6))])
    monkeypatch.setattr(algorithms.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    env: dict[str, str] = {}
    algorithms.rank_cores(2, env)
    assert env == {algorithms.CPU_BIND_ENV: "0-2|3,5"}
    env = {}
    algorithms.rank_cores(5, env)
    assert env[algorithms.CPU_BIND_ENV] == "0|1|2|3|5"
    env = {algorithms.CPU_BIND_ENV: "0|1"}
    algorithms.rank_cores(2, env)
    assert env == {algorithms.CPU_BIND_ENV: "0|1"}
    env = {}
    algorithms.rank_cores(1, env)
    assert env == {}
    # --nnodes 2 with tp 2: one rank on this node, but SGLang compares all nodes' ranks with
    # this host's NUMA nodes, so the node's one rank still gets a list (all its cores)
    env = {}
    algorithms.rank_cores(2, env, local_ranks=1)
    assert env == {algorithms.CPU_BIND_ENV: "0,1,2,3,5"}


def test_local_ranks_of_a_multi_node_launch() -> None:
    from sgl_spec.argv import LaunchArgs

    argv = ["--tp-size", "4", "--nnodes", "2", "--node-rank", "1"]
    launch = LaunchArgs.from_argv([*argv, "--device", "cpu"])
    assert (launch.num_ranks, launch.nnodes, launch.local_ranks) == (4, 2, 2)
    assert LaunchArgs.from_argv(["--device", "cpu"]).local_ranks == 1
