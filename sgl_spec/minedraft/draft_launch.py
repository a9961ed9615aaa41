"""Start the draft server of one MINEDRAFT scheduler: the Hello it is sent, the split of the
host's cores between the target and a ``cpu:N`` draft server, and the supervised link
(``link.py``) the worker drafts through.
"""

from __future__ import annotations

import logging
import os
import uuid

import torch

from sgl_spec.minedraft.client import DraftServerClient
from sgl_spec.minedraft.link import DraftLink
from sgl_spec.minedraft.messages import Hello
from sgl_spec.minedraft.settings import MineDraftSettings

logger = logging.getLogger(__name__)


def start_draft_link(settings: MineDraftSettings, server_args) -> DraftLink:
    """Spawn the draft server with ``settings``, move the target off its cores, and return the
    started link."""
    hello = Hello(
        draft_model_path=settings.draft_model_path,
        device=settings.device,
        num_steps=settings.num_steps,
        num_draft_tokens=settings.width,
        topk=1,
        max_batch_size=settings.max_batch_size,
        seed=int(server_args.random_seed or 0),
        max_total_tokens=int(server_args.max_total_tokens or 0),
        drafter=settings.drafter,
    )
    # The draft server picks its cores from the affinity it inherits: the full set.
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    client = DraftServerClient(
        hello, f"{os.getpid()}-{uuid.uuid4().hex[:8]}", cpu_affinity=affinity
    )
    link = DraftLink(client, settings.draft_timeout_s)
    leave_draft_cores(settings.device)
    link.start()
    logger.info(
        "MINEDRAFT: draft server pid %s on %s (%s %s), %d drafts per request, policy %s",
        client.pid,
        settings.device,
        settings.drafter,
        settings.draft_model_path,
        settings.num_steps,
        settings.policy,
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
