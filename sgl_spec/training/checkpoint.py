"""Checkpoints of a training run: written so that an interrupted save never leaves a torn file,
read back only for a run that would reproduce the one that wrote them.

A checkpoint is one dict: the trained module's entries (``ModuleCheckpoint.entries``: its state
dict and whatever a resume must check), ``optimizer``, ``step``, ``train_config`` (``asdict`` of
the config, compared by ``check_resumable``) and the log so far, where the trainer's
``LogLayout`` puts it: under ``log`` (``NESTED_LOG``), or as entries of its own beside the others.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sgl_spec.training.schedule import ScheduleConfig, check_resumable

Log = dict[str, Any]
"""``losses``, one list per key of the steps' log values, ``elapsed_s`` and ``cpu_s``."""


@dataclass(frozen=True)
class LogLayout:
    """Where a checkpoint keeps the run's log."""

    entries: Callable[[Log], dict[str, Any]]  # the log -> its checkpoint entries
    read: Callable[[dict[str, Any]], Log]  # a loaded checkpoint -> the log


NESTED_LOG = LogLayout(entries=lambda log: {"log": log}, read=lambda state: state["log"])
"""The whole log under one ``log`` entry."""


@dataclass(frozen=True)
class ModuleCheckpoint:
    """What a checkpoint holds of the trained module, and how its log is laid out."""

    entries: Callable[[], dict[str, Any]]  # the module's entries: state dict, what resume checks
    restore: Callable[[dict[str, Any]], None]  # a loaded checkpoint -> the module restored
    log_layout: LogLayout = NESTED_LOG


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write through a temporary file, so an interrupted save never leaves a torn checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path | None, cfg: ScheduleConfig) -> dict[str, Any]:
    """The checkpoint at ``path``, refused unless it was written with hyper-parameters a fresh
    run with ``cfg`` would reproduce."""
    if path is None or not path.is_file():
        raise FileNotFoundError(f"--resume given but checkpoint {path} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=False)
    check_resumable(type(cfg)(**state["train_config"]), cfg, state["step"])
    return state


def checkpoint_state(
    module: ModuleCheckpoint,
    opt: torch.optim.Optimizer,
    done: int,
    log: Log,
    cfg: ScheduleConfig,
) -> dict[str, Any]:
    """The checkpoint after ``done`` steps: the module's entries, the optimizer, the step, the
    log (laid out by ``module.log_layout``) and the train config."""
    return {
        **module.entries(),
        "optimizer": opt.state_dict(),
        "step": done,
        **module.log_layout.entries(log),
        "train_config": asdict(cfg),
    }


def resume(
    path: Path | None, cfg: ScheduleConfig, opt: torch.optim.Optimizer, module: ModuleCheckpoint
) -> tuple[int, Log]:
    """Restore the module and the optimizer from the checkpoint at ``path``; returns the step to
    continue from and the log so far."""
    state = load_checkpoint(path, cfg)
    module.restore(state)
    opt.load_state_dict(state["optimizer"])
    return state["step"], module.log_layout.read(state)
