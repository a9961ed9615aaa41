"""``--speculative-algorithm MINEDRAFT``: registration, start-up validation, runtime settings.

SGLang's usual draft flags describe the drafter: ``--speculative-draft-model-path`` (the draft
LM the draft-server process loads), ``--speculative-num-steps`` (chain length per request per
step; default 3) and ``--speculative-num-draft-tokens`` (verified tokens, steps + 1). Ours add
the draft server's device (``--speculative-draft-device``) and MineDraft's knobs
(``SpecConfig``). Every problem is refused at start-up with one message naming the flag.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from sgl_spec.config import SpecConfig
from sgl_spec.spec_algo import OwnDraftStateSpecAlgo, require_single_rank

logger = logging.getLogger(__name__)
NAME = "MINEDRAFT"
DEFAULT_NUM_STEPS = 3
DEFAULT_MAX_BATCH = 128  # requests per batch when --max-running-requests is not given


@dataclass(frozen=True)
class MineDraftSettings:
    draft_model_path: str
    device: str  # the draft server's (cuda:N, cpu, cpu:N)
    num_steps: int  # drafts per request per step (a chain)
    policy: str
    draft_timeout_s: float
    max_batch_size: int
    overlap: bool = True  # False: every step is standard SD (--minedraft-overlap off)
    drafter: str = "model"  # --minedraft-drafter: "model" (draft LM) or "specblock"

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
    from sgl_spec.minedraft.draft_server import parse_device

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
    if spec.kind == "cpu" and spec.index is not None:
        available = len(os.sched_getaffinity(0))
        if spec.index >= available:
            raise ValueError(
                f"--speculative-draft-device {draft_device}: this process has {available}"
                " cores; the target needs at least one of them"
            )


def load_settings(config: SpecConfig, server_args: Any) -> MineDraftSettings:
    from sgl_spec.models.registry import resolve_model_path

    if config.minedraft_drafter == "specblock":
        from sgl_spec.specblock.algorithm import read_drafter_config, resolve_drafter_path

        try:
            path = resolve_drafter_path(config.specblock_drafter_path)
        except ValueError as exc:
            raise ValueError(f"--minedraft-drafter specblock: {exc}") from exc
        read_drafter_config(path)
    else:
        path = server_args.speculative_draft_model_path
        if path is None:
            raise ValueError("MINEDRAFT needs --speculative-draft-model-path (the draft LM)")
        try:
            path = resolve_model_path(path)
        except ValueError as exc:
            raise ValueError(f"--speculative-draft-model-path: {exc}") from exc
    device = config.speculative_draft_device or default_draft_device(server_args.device)
    check_device(device, server_args.device, int(server_args.base_gpu_id or 0))
    num_steps = int(server_args.speculative_num_steps or DEFAULT_NUM_STEPS)
    if num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1 for MINEDRAFT, got {num_steps}")
    return MineDraftSettings(
        draft_model_path=path,
        device=device,
        num_steps=num_steps,
        policy=config.minedraft_policy,
        draft_timeout_s=float(config.minedraft_draft_timeout),
        max_batch_size=int(server_args.max_running_requests or DEFAULT_MAX_BATCH),
        overlap=config.minedraft_overlap == "on",
        drafter=config.minedraft_drafter,
    )


class MineDraftSpecAlgo(OwnDraftStateSpecAlgo):
    """The draft model and its KV live in the draft-server process, not in SGLang."""

    def handle_server_args(self, server_args: Any) -> None:
        require_single_rank(NAME, server_args)
        settings = load_settings(SpecConfig.from_env(), server_args)
        topk = server_args.speculative_eagle_topk
        if topk not in (None, 1):
            raise ValueError(f"MINEDRAFT drafts chains: --speculative-eagle-topk 1, not {topk}")
        tokens = server_args.speculative_num_draft_tokens
        if tokens not in (None, settings.width):
            raise ValueError(
                f"MINEDRAFT: --speculative-num-draft-tokens must be --speculative-num-steps + 1"
                f" = {settings.width} for a chain, got {tokens}"
            )
        server_args.speculative_num_steps = settings.num_steps
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = settings.width
        if str(server_args.device).startswith("cuda") and not server_args.disable_cuda_graph:
            logger.warning("MINEDRAFT: disabling CUDA graphs (the batch is split every step)")
            server_args.disable_cuda_graph = True


def check_launch_args(config: SpecConfig, argv: list[str]) -> None:
    """In the launcher, before SGLang starts: refuse bad MINEDRAFT settings with one message
    (``ConfigError``) naming the flag."""
    from types import SimpleNamespace

    from sgl_spec.argv import flag_value
    from sgl_spec.config import ConfigError

    if (flag_value(argv, "--speculative-algorithm") or "").upper() != NAME:
        if config.speculative_draft_device is not None:
            raise ConfigError("--speculative-draft-device needs --speculative-algorithm MINEDRAFT")
        return
    device = flag_value(argv, "--device")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = flag_value(argv, "--speculative-num-steps")
    running = flag_value(argv, "--max-running-requests")
    args = SimpleNamespace(
        speculative_draft_model_path=flag_value(argv, "--speculative-draft-model-path"),
        device=device,
        base_gpu_id=int(flag_value(argv, "--base-gpu-id") or 0),
        speculative_num_steps=int(steps) if steps and steps.isdigit() else None,
        max_running_requests=int(running) if running and running.isdigit() else None,
    )
    try:
        settings = load_settings(config, args)
        topk = flag_value(argv, "--speculative-eagle-topk")
        if topk not in (None, "1"):
            raise ValueError(f"MINEDRAFT drafts chains: --speculative-eagle-topk 1, not {topk}")
        tokens = flag_value(argv, "--speculative-num-draft-tokens")
        if tokens is not None and tokens != str(settings.width):
            raise ValueError(
                f"MINEDRAFT: --speculative-num-draft-tokens must be --speculative-num-steps + 1"
                f" = {settings.width} for a chain, got {tokens}"
            )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def register() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    @SpeculativeAlgorithm.register(NAME, supports_overlap=False, spec_class=MineDraftSpecAlgo)
    def _factory(server_args: Any) -> type:
        from sgl_spec.minedraft.worker import MineDraftWorker

        return MineDraftWorker
