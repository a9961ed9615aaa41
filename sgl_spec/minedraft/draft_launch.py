"""Start the draft server of one MINEDRAFT replica: the Hello it is sent, the split of the
host's cores between the target and a ``cpu:N`` draft server, and the supervised link
(``link.py``) the worker drafts through, shared with the replica's other tensor ranks
(``rank_link.py``).

With one rank the draft server takes the last N cores of the scheduler's and the target keeps
the others. With more ranks the launcher has already kept the draft servers' cores out of the
ranks' core lists and names them per data-parallel replica in ``DRAFT_CORES_ENV``
(``settings.plan_draft_cores``).
"""

from __future__ import annotations

import logging
import os
import uuid

import torch

from sgl_spec.control.ranks import tensor_parallel_group
from sgl_spec.minedraft.client import DraftServerClient
from sgl_spec.minedraft.link import DraftLink
from sgl_spec.minedraft.messages import Hello
from sgl_spec.minedraft.rank_link import RankedLink
from sgl_spec.minedraft.settings import DRAFT_CORES_ENV, MineDraftSettings, parse_cpu_list

logger = logging.getLogger(__name__)


def start_ranked_link(settings: MineDraftSettings, server_args, vocab_size: int) -> RankedLink:
    """This replica's draft link as this rank sees it: tensor rank 0 starts the draft server
    (on the replica's device), the other ranks receive its drafts."""
    from sglang.srt.distributed.parallel_state import get_parallel

    group = tensor_parallel_group()
    link = None
    if group is None or group.rank_in_group == 0:
        try:
            dp_rank = get_parallel().dp_rank or 0
        except RuntimeError:
            dp_rank = 0
        single = group is None and int(getattr(server_args, "dp_size", 1) or 1) == 1
        link = start_draft_link(settings, server_args, dp_rank, single)
    return RankedLink(link, group, vocab_size, settings.num_steps)


def replica_cores(dp_rank: int) -> list[int] | None:
    """The cores the launcher set apart for replica ``dp_rank``'s draft server, if any."""
    lists = [part for part in os.environ.get(DRAFT_CORES_ENV, "").split("|") if part]
    if not lists:
        return None
    return sorted(parse_cpu_list(lists[dp_rank % len(lists)]))


def start_draft_link(
    settings: MineDraftSettings, server_args, dp_rank: int = 0, single: bool = True
) -> DraftLink:
    """Spawn replica ``dp_rank``'s draft server with ``settings`` and return the started link;
    ``single`` (one rank in all): move the target off the draft server's cores."""
    device = settings.device_for(dp_rank)
    hello = Hello(
        draft_model_path=settings.draft_model_path,
        device=device,
        num_steps=settings.num_steps,
        num_draft_tokens=settings.width,
        topk=1,
        max_batch_size=settings.max_batch_size,
        seed=int(server_args.random_seed or 0),
        max_total_tokens=int(server_args.max_total_tokens or 0),
        drafter=settings.drafter,
    )
    # The draft server picks its cores from the affinity it is given: with one rank the full
    # set (it takes the last N), else the cores the launcher set apart for it.
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if not single:
        affinity = replica_cores(dp_rank) or affinity
    client = DraftServerClient(
        hello, f"{os.getpid()}-{uuid.uuid4().hex[:8]}", cpu_affinity=affinity
    )
    link = DraftLink(client, settings.draft_timeout_s)
    if single:
        leave_draft_cores(device)
    link.start()
    logger.info(
        "MINEDRAFT: draft server pid %s on %s (%s %s), %d drafts per request, policy %s; "
        "its log: %s",
        client.pid,
        device,
        settings.drafter,
        settings.draft_model_path,
        settings.num_steps,
        settings.policy,
        client.log_path,
    )
    return link


def leave_draft_cores(device: str) -> None:
    """``cpu:N``: the draft server takes the last N cores; the target keeps the others."""
    from sgl_spec.minedraft.devices import cpu_core_set, parse_device

    spec = parse_device(device)
    if spec.kind != "cpu" or spec.index is None or not hasattr(os, "sched_setaffinity"):
        return
    available = sorted(os.sched_getaffinity(0))
    mine = sorted(set(available) - set(cpu_core_set(spec.index, available)))
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    logger.info("MINEDRAFT: target on cores %s", ",".join(map(str, mine)))
