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


@dataclass(frozen=True)
class MineDraftSettings:
    draft_model_path: str
    device: str  # the draft server's (cuda:N, cpu, cpu:N)
    num_steps: int  # drafts per request per step (a chain)
    policy: str
    draft_timeout_s: float
    max_batch_size: int
    overlap: bool = True  # False: every step is standard SD (--minedraft-overlap off)
    steps_mode: str = "fixed"  # --minedraft-steps: who chooses the drafts verified per step
    drafter: str = "model"  # --minedraft-drafter: "model" (draft LM) or "specblock"
    # the hosted SpecBlock drafter's DrafterConfig, read once with the settings (else None)
    drafter_config: Any = None

    @property
    def width(self) -> int:
        return self.num_steps + 1  # verified tokens per request: root + drafts


def default_draft_device(device: str) -> str:
    """The last GPU when there are two or more (the target keeps the others), else ``cpu:1``
    on a CPU host. A single-GPU host has no device to spare: refused."""
    if str(device).startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        if count < 2:
            raise ValueError(
                "MINEDRAFT needs a device of its own for the draft server: pass"
                " --speculative-draft-device (cuda:N of a second GPU, or cpu:N)"
            )
        return f"cuda:{count - 1}"
    return "cpu:1"


def check_device(draft_device: str, target_device: str, base_gpu_id: int) -> None:
    from sgl_spec.minedraft.devices import cpu_core_set, parse_device

    try:
        spec = parse_device(draft_device)
    except ValueError as exc:
        raise ValueError(f"--speculative-draft-device: {exc}") from exc
    if spec.kind == "cuda" and not str(target_device).startswith("cuda"):
        raise ValueError(
            f"--speculative-draft-device {draft_device}: the target runs on {target_device}"
        )
    if spec.kind == "cuda" and spec.index == base_gpu_id:
        raise ValueError(
            f"--speculative-draft-device {draft_device} is the target's GPU; MINEDRAFT drafts"
            " on a device of its own (paper §5)"
        )
    if spec.kind == "cuda":
        import torch

        count = torch.cuda.device_count()
        if spec.index >= count:
            raise ValueError(
                f"--speculative-draft-device {draft_device}: this host has {count} GPU(s)"
                f" (cuda:0..cuda:{count - 1})"
            )
    if spec.kind == "cpu" and spec.index is not None:
        available = sorted(os.sched_getaffinity(0))
        if spec.index >= len(available):
            raise ValueError(
                f"--speculative-draft-device {draft_device}: this process has {len(available)}"
                " cores; the target needs at least one of them"
            )
        if not str(target_device).startswith("cuda"):
            check_target_cores(draft_device, cpu_core_set(spec.index, available))


def check_target_cores(draft_device: str, draft_cores: list[int]) -> None:
    """The target leaves a ``cpu:N`` draft server's cores alone, unless the user pinned the
    target's threads onto them with SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` (its first
    ``|``-separated group binds the one target rank)."""
    bind = os.environ.get(BIND_ENV, "").strip()
    if not bind or bind == "all":
        return
    try:
        target_cores = parse_cpu_list(bind.split("|")[0])
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
    device = config.speculative_draft_device or default_draft_device(launch.device)
    check_device(device, launch.device, launch.base_gpu_id)
    num_steps = DEFAULT_NUM_STEPS if launch.num_steps is None else launch.num_steps
    if num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1 for MINEDRAFT, got {num_steps}")
    return MineDraftSettings(
        draft_model_path=path,
        device=device,
        num_steps=num_steps,
        policy=config.minedraft_policy,
        draft_timeout_s=float(config.minedraft_draft_timeout),
        max_batch_size=launch.max_running_requests or DEFAULT_MAX_BATCH,
        overlap=config.minedraft_overlap == "on",
        steps_mode=config.minedraft_steps,
        drafter=config.minedraft_drafter,
        drafter_config=drafter_config,
    )


def feature_bytes_per_token(settings: MineDraftSettings, dtype: Any) -> int:
    """Bytes per target KV location of the worker's feature cache: the target's (low, mid,
    top) hidden states the hosted SpecBlock drafter conditions on; 0 for a draft model."""
    if settings.drafter != "specblock":
        return 0
    import torch

    width = settings.drafter_config.target_hidden_size
    return 3 * width * torch.empty((), dtype=dtype).element_size()
