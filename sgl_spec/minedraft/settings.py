"""MINEDRAFT's settings. SGLang's usual draft flags describe the drafter:
``--speculative-draft-model-path`` (the draft LM the draft-server process loads),
``--speculative-num-steps`` (chain length per request per step; default 3) and
``--speculative-num-draft-tokens`` (verified tokens, steps + 1). Ours add the draft server's
device (``--speculative-draft-device``) and MineDraft's knobs (``SpecConfig``). Every problem is
refused with one message naming the flag."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from sgl_spec.argv import LaunchArgs
from sgl_spec.config import SpecConfig

DEFAULT_NUM_STEPS = 3
DEFAULT_MAX_BATCH = 128  # requests per batch when --max-running-requests is not given
BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# The cores the launcher set apart for the draft servers with two ranks or more: one
# comma-separated list per data-parallel replica, "|"-separated (plan_draft_cores).
DRAFT_CORES_ENV = "SGL_SPEC_DRAFT_CORES"


@dataclass(frozen=True)
class MineDraftSettings:
    draft_model_path: str
    device: str  # the draft server's (cuda:N, cpu, cpu:N); replica 0's with --dp-size
    num_steps: int  # drafts per request per step (a chain)
    policy: str
    draft_timeout_s: float
    max_batch_size: int
    overlap: bool = True  # False: every step is standard SD (--minedraft-overlap off)
    steps_mode: str = "fixed"  # --minedraft-steps: who chooses the drafts verified per step
    drafter: str = "model"  # --minedraft-drafter: "model" (draft LM) or "specblock"
    # the hosted SpecBlock drafter's DrafterConfig, read once with the settings (else None)
    drafter_config: Any = None
    # every data-parallel replica's draft device (its own draft server), replica 0's first
    replica_devices: tuple[str, ...] = ()

    def device_for(self, dp_rank: int) -> str:
        """Replica ``dp_rank``'s draft device."""
        devices = self.replica_devices or (self.device,)
        return devices[dp_rank % len(devices)]

    @property
    def width(self) -> int:
        return self.num_steps + 1  # verified tokens per request: root + drafts


def default_draft_devices(launch: LaunchArgs) -> tuple[str, ...]:
    """One draft device per data-parallel replica. On GPUs: the GPUs the target's ranks leave
    free, from the last one down, shared round-robin when replicas outnumber them (none free:
    refused). On a CPU host: ``cpu:1``, a core of its own, where the launcher could set one
    apart per replica beside the ranks' (always with one rank), else ``cpu`` (the draft server
    shares the first rank's cores)."""
    replicas = launch.dp_size
    if str(launch.device).startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        taken = target_gpus(launch)
        spare = [gpu for gpu in reversed(range(count)) if gpu not in taken]
        if not spare:
            raise ValueError(
                "MINEDRAFT needs a device of its own for the draft server: the target's"
                f" {len(taken)} rank(s) use all {count} GPU(s); pass"
                " --speculative-draft-device (cuda:N of another GPU, or cpu:N)"
            )
        return tuple(f"cuda:{spare[replica % len(spare)]}" for replica in range(replicas))
    if launch.num_ranks == 1 or os.environ.get(DRAFT_CORES_ENV):
        return ("cpu:1",) * replicas
    return ("cpu",) * replicas


def target_gpus(launch: LaunchArgs) -> set[int]:
    """The GPUs this node's target ranks use (SGLang: one per rank from ``--base-gpu-id``)."""
    return set(range(launch.base_gpu_id, launch.base_gpu_id + launch.local_ranks))


def check_device(draft_device: str, launch: LaunchArgs) -> None:
    from sgl_spec.minedraft.devices import cpu_core_set, parse_device

    try:
        spec = parse_device(draft_device)
    except ValueError as exc:
        raise ValueError(f"--speculative-draft-device: {exc}") from exc
    target_device = str(launch.device)
    if spec.kind == "cuda" and not target_device.startswith("cuda"):
        raise ValueError(
            f"--speculative-draft-device {draft_device}: the target runs on {target_device}"
        )
    if spec.kind == "cuda" and spec.index in target_gpus(launch):
        raise ValueError(
            f"--speculative-draft-device {draft_device} is one of the target's GPUs; MINEDRAFT"
            " drafts on a device of its own (paper §5)"
        )
    if spec.kind == "cuda":
        import torch

        count = torch.cuda.device_count()
        if spec.index >= count:
            raise ValueError(
                f"--speculative-draft-device {draft_device}: this host has {count} GPU(s)"
                f" (cuda:0..cuda:{count - 1})"
            )
    if spec.kind != "cpu" or spec.index is None:
        return
    if launch.num_ranks > 1:  # the launcher sets the cores apart (plan_draft_cores)
        if not os.environ.get(DRAFT_CORES_ENV) and not target_device.startswith("cuda"):
            plan_draft_cores(draft_device, launch, dict(os.environ))
        return
    available = sorted(os.sched_getaffinity(0))
    if spec.index >= len(available):
        raise ValueError(
            f"--speculative-draft-device {draft_device}: this process has {len(available)}"
            " cores; the target needs at least one of them"
        )
    if not target_device.startswith("cuda"):
        check_target_cores(draft_device, cpu_core_set(spec.index, available))


def plan_draft_cores(
    draft_device: str | None, launch: LaunchArgs, environ: dict[str, str]
) -> list[int]:
    """With two target ranks or more on this CPU: the cores set apart for the draft servers of
    this node's replicas (``cpu:N``: N each, the last cores of this process's), named per
    replica in ``environ[DRAFT_CORES_ENV]`` (``"6|7"``); returned so that the ranks' core lists
    leave them out. A default device takes one core per replica where the ranks keep a core
    each, else none (the draft server then shares the first rank's). ``ValueError`` where a
    ``cpu:N`` asked for does not fit beside the ranks, or the user's own rank binding
    (``SGLANG_CPU_OMP_THREADS_BIND``) covers its cores."""
    from sgl_spec.minedraft.devices import parse_device

    if launch.num_ranks == 1:
        return []
    spec = parse_device(draft_device or "cpu:1")
    if spec.kind != "cpu" or spec.index is None:
        return []
    cores = sorted(os.sched_getaffinity(0))
    replicas = -(-launch.dp_size // launch.nnodes)
    taken = spec.index * replicas
    need = taken + launch.local_ranks
    bind = (environ.get(BIND_ENV) or "all").strip()
    if draft_device is None and (bind != "all" or need > len(cores)):
        return []
    if need > len(cores):
        raise ValueError(
            f"--speculative-draft-device {draft_device}: {replicas} draft server(s) of"
            f" {spec.index} core(s) beside {launch.local_ranks} target rank(s) need"
            f" {need} cores; this process may use {len(cores)}"
        )
    mine = cores[len(cores) - taken :]
    if bind != "all":
        for group in bind.split("|"):
            check_target_cores(draft_device, mine, group)
    parts = [mine[i * spec.index : (i + 1) * spec.index] for i in range(replicas)]
    environ[DRAFT_CORES_ENV] = "|".join(",".join(map(str, part)) for part in parts)
    return mine


def check_target_cores(draft_device: str, draft_cores: list[int], bind: str | None = None) -> None:
    """The target leaves a ``cpu:N`` draft server's cores alone, unless the user pinned the
    target's threads onto them with SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` (``bind``: one
    rank's list; default the variable's first ``|``-separated group, the one target rank's)."""
    if bind is None:
        bind = os.environ.get(BIND_ENV, "").strip().split("|")[0]
    if not bind or bind == "all":
        return
    try:
        target_cores = parse_cpu_list(bind)
    except ValueError:
        raise ValueError(f"{BIND_ENV}={bind!r} is not a list of cores such as 0-3,5") from None
    shared = sorted(target_cores & set(draft_cores))
    if shared:
        raise ValueError(
            f"--speculative-draft-device {draft_device} takes cores {draft_cores}, and"
            f" {BIND_ENV}={bind} puts the target on {shared} too; MINEDRAFT drafts on cores"
            " of its own (paper §5)"
        )


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,5"`` -> ``{0, 1, 2, 3, 5}`` (the kernel's cpulist format)."""
    cores: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def load_settings(config: SpecConfig, launch: LaunchArgs) -> MineDraftSettings:
    from sgl_spec.common.checkpoints import check_draft_model
    from sgl_spec.models.registry import resolve_model_path

    drafter_config = None
    if config.minedraft_drafter == "specblock":
        from sgl_spec.specblock.settings import check_model_dir, read_drafter, resolve_drafter_path

        try:
            path = resolve_drafter_path(config.specblock_drafter_path)
        except ValueError as exc:
            raise ValueError(f"--minedraft-drafter specblock: {exc}") from exc
        drafter_config = read_drafter(path)
        if launch.model_path is not None:
            check_model_dir(path, launch.model_path)
    else:
        path = launch.draft_model_path
        if path is None:
            raise ValueError("MINEDRAFT needs --speculative-draft-model-path (the draft LM)")
        try:
            path = resolve_model_path(path)
        except ValueError as exc:
            raise ValueError(f"--speculative-draft-model-path: {exc}") from exc
        check_draft_model(path, launch)
    given = config.speculative_draft_device
    devices = (given,) * launch.dp_size if given else default_draft_devices(launch)
    check_device(devices[0], launch)
    num_steps = DEFAULT_NUM_STEPS if launch.num_steps is None else launch.num_steps
    if num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1 for MINEDRAFT, got {num_steps}")
    return MineDraftSettings(
        draft_model_path=path,
        device=devices[0],
        num_steps=num_steps,
        policy=config.minedraft_policy,
        draft_timeout_s=float(config.minedraft_draft_timeout),
        max_batch_size=launch.max_running_requests or DEFAULT_MAX_BATCH,
        overlap=config.minedraft_overlap == "on",
        steps_mode=config.minedraft_steps,
        drafter=config.minedraft_drafter,
        drafter_config=drafter_config,
        replica_devices=devices,
    )


def feature_bytes_per_token(settings: MineDraftSettings, dtype: Any) -> int:
    """Bytes per target KV location of the worker's feature cache: the target's (low, mid,
    top) hidden states the hosted SpecBlock drafter conditions on; 0 for a draft model."""
    if settings.drafter != "specblock":
        return 0
    import torch

    width = settings.drafter_config.target_hidden_size
    return 3 * width * torch.empty((), dtype=dtype).element_size()
