"""MINEDRAFT beyond one rank: rank 0's drafts shared with every tensor rank (``rank_link.py``),
each data-parallel replica's draft device, and the CPU cores set apart for the draft servers
beside the ranks' (``settings.plan_draft_cores``, ``algorithms.rank_cores``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sgl_spec.algorithms import rank_cores
from sgl_spec.argv import LaunchArgs
from sgl_spec.minedraft import settings as md_settings
from sgl_spec.minedraft.link import DraftJob, DraftLink
from sgl_spec.minedraft.rank_link import RankedLink
from tests.helpers.gloo import run_two_ranks

VOCAB = 100
GOOD = {"a": (10, np.array([1, 2, 3], np.int32)), "b": (7, np.array([4], np.int32))}
MALFORMED = {"a": (10, np.array([1, 500], np.int32))}  # 500 is past the vocabulary


class FakeLink:
    """Rank 0's link: ``collect`` answers from ``replies``; the real drafts check."""

    check_output = DraftLink.check_output

    def __init__(self, replies: dict[int, object], submit_ok: bool = True) -> None:
        self.replies = replies
        self.submit_ok = submit_ok
        self.faults: list[str] = []
        self.submitted: list[int] = []
        self.num_faults = self.num_restarts = 0
        self.on_restart = None

    def submit(self, step_id: int, batch_id: int, jobs) -> bool:
        self.submitted.append(step_id)
        return self.submit_ok

    def collect(self, step_id: int):
        return self.replies.get(step_id)

    def fault(self, reason: str) -> None:
        self.faults.append(reason)

    def removed(self, rids) -> None:
        pass

    def close(self) -> None:
        pass


class GlooGroup:
    """The part of SGLang's GroupCoordinator a RankedLink uses, on a gloo group."""

    def __init__(self, rank: int) -> None:
        self.rank_in_group = rank
        self.world_size = 2

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]


def _share(rank: int, store: str, results: dict) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2
    )
    try:
        replies = {1: (GOOD, 0.25), 2: (MALFORMED, 0.1)}  # step 3: no reply (a fault, late)
        link = FakeLink(replies) if rank == 0 else None
        shared = RankedLink(link, GlooGroup(rank), VOCAB, max_len=3)
        got = []
        for step in (1, 2, 3):
            jobs = [DraftJob("a", [5] * 10, 4, None)]
            assert shared.submit(step, 0, jobs)  # every rank then collects
            reply = shared.collect(step)
            got.append(
                None
                if reply is None
                else ({rid: (n, ids.tolist()) for rid, (n, ids) in reply[0].items()}, reply[1])
            )
        results[rank] = {
            "got": got,
            "faults": [] if link is None else link.faults,
            "submitted": [] if link is None else link.submitted,
        }
    finally:
        torch.distributed.destroy_process_group()


def test_rank_zero_drafts_reach_every_tensor_rank() -> None:
    """Both ranks verify exactly the drafts rank 0 checked; malformed ones are a fault on rank
    0 and reach no rank; a step without a reply has no drafts on either; only rank 0 sends."""
    results = run_two_ranks(_share)
    expected = [({"a": (10, [1, 2, 3]), "b": (7, [4])}, 0.25), None, None]
    assert results[0]["got"] == expected
    assert results[1]["got"] == expected
    assert results[0]["submitted"] == [1, 2, 3] and results[1]["submitted"] == []
    assert len(results[0]["faults"]) == 1 and "malformed" in results[0]["faults"][0]


def test_one_rank_keeps_the_links_own_answers() -> None:
    link = FakeLink({1: (GOOD, 0.5)}, submit_ok=False)
    shared = RankedLink(link, None, VOCAB, max_len=3)
    assert not shared.submit(1, 0, [])  # no group: a failed submit is not collected
    got = shared.collect(1)
    assert got is not None and set(got[0]) == {"a", "b"}
    with pytest.raises(ValueError, match="single rank"):
        RankedLink(None, None, VOCAB, max_len=3)


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv(md_settings.DRAFT_CORES_ENV, raising=False)
    monkeypatch.delenv(md_settings.BIND_ENV, raising=False)


def test_draft_cores_are_kept_out_of_the_ranks_lists(eight_cores) -> None:
    """tp 2 x dp 2 with cpu:1: the last two cores, one per replica's draft server; the four
    ranks split the other six."""
    launch = LaunchArgs(algorithm="MINEDRAFT", tp_size=2, dp_size=2)
    environ: dict[str, str] = {}
    apart = md_settings.plan_draft_cores("cpu:1", launch, environ)
    assert apart == [6, 7] and environ[md_settings.DRAFT_CORES_ENV] == "6|7"
    rank_cores(launch.num_ranks, environ, launch.local_ranks, apart)
    assert environ[md_settings.BIND_ENV] == "0-1|2-3|4|5"
    environ = {}
    assert md_settings.plan_draft_cores("cpu:2", LaunchArgs(tp_size=2), environ) == [6, 7]
    assert environ[md_settings.DRAFT_CORES_ENV] == "6,7"


def test_draft_cores_that_do_not_fit_are_refused_or_shared(eight_cores) -> None:
    launch = LaunchArgs(algorithm="MINEDRAFT", tp_size=4, dp_size=2)  # 8 ranks on 8 cores
    environ: dict[str, str] = {}
    assert md_settings.plan_draft_cores(None, launch, environ) == []  # default: shares
    assert md_settings.DRAFT_CORES_ENV not in environ
    assert md_settings.default_draft_devices(launch) == ("cpu", "cpu")
    with pytest.raises(ValueError, match="need 10 cores; this process may use 8"):
        md_settings.plan_draft_cores("cpu:1", launch, environ)
    # the user's own binding of the ranks may not cover the draft server's cores
    bind = {md_settings.BIND_ENV: "0-3|4-7"}
    with pytest.raises(ValueError, match="puts the target on"):
        md_settings.plan_draft_cores("cpu:1", LaunchArgs(tp_size=2), bind)
    assert md_settings.plan_draft_cores("cpu:1", LaunchArgs(), {}) == []  # one rank: worker's


def test_default_gpus_leave_the_targets_alone(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    devices = md_settings.default_draft_devices
    assert devices(LaunchArgs(device="cuda", tp_size=4)) == ("cuda:7",)
    assert devices(LaunchArgs(device="cuda", tp_size=2, dp_size=2)) == ("cuda:7", "cuda:6")
    assert devices(LaunchArgs(device="cuda", tp_size=1, base_gpu_id=7)) == ("cuda:6",)
    with pytest.raises(ValueError, match="use all 8 GPU"):
        devices(LaunchArgs(device="cuda", tp_size=8))
    with pytest.raises(ValueError, match="one of the target's GPUs"):
        md_settings.check_device("cuda:1", LaunchArgs(device="cuda", tp_size=2))
    md_settings.check_device("cuda:2", LaunchArgs(device="cuda", tp_size=2))
    replicas = md_settings.MineDraftSettings(
        "m", "cuda:7", 3, "balanced", 1.0, 8, replica_devices=("cuda:7", "cuda:6")
    )
    assert [replicas.device_for(r) for r in range(3)] == ["cuda:7", "cuda:6", "cuda:7"]
