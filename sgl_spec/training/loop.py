"""The optimisation loop of the adapter and drafter trainers (``sgl_spec.mtp.training.trainer``,
``sgl_spec.specblock.training.trainer``).

A trainer brings one step: ``step_fn(step)`` draws the batch of ``step`` (a pure function of
``(seed, step)``), runs the forward and returns the loss and that step's log values. The rest is
the same for both and lives here: the LR of the step (``lr_at`` of the shipped models' trainer:
warm-up / constant / cosine), backward, gradient clipping, the optimizer step, wall and CPU time
accumulated across resumed segments, the progress bar, and checkpoints every
``checkpoint_every`` steps, at the last step and at ``stop_after`` (a time-sliced run on a shared
machine).

Why a resumed run continues bit-exactly: the checkpoint holds the trained module's entries
(``state_fn``), the optimizer, the step, the log and the train config; a resume with different
hyper-parameters is refused (``check_resumable``) rather than silently mixed, and the batches
depend only on ``(seed, step)``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from sgl_spec.models.build.trainer import (
    check_resumable,
    checkpoint_due,
    lr_at,
    progress_bar,
    stop_reached,
)

StepFn = Callable[[int], tuple[torch.Tensor, dict[str, Any]]]
"""``step -> (loss, {log key: value of this step})``; the loop backpropagates the loss."""


class LoopConfig(Protocol):
    """The fields the loop reads; a frozen dataclass whose names match
    ``sgl_spec.models.build.trainer.TrainConfig`` (so ``lr_at`` and ``check_resumable`` apply)."""

    steps: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    decay_fraction: float
    grad_clip: float


@dataclass(frozen=True)
class RunOptions:
    """How a run is driven, as opposed to what it optimises: none of this is in the train config,
    so changing it never blocks a resume."""

    checkpoint: Path | None = None  # where the run is checkpointed (None: not at all)
    resume: bool = False  # continue from ``checkpoint``
    checkpoint_every: int = 25
    progress: bool = True  # tqdm bar
    stop_after: int | None = None  # stop, checkpointed, once this many steps are done


def new_log(keys: Sequence[str]) -> dict[str, Any]:
    """The empty log: ``losses``, one list per key of the step's log values, then the times."""
    return {"losses": [], **{key: [] for key in keys}, "elapsed_s": 0.0, "cpu_s": 0.0}


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write through a temporary file, so an interrupted save never leaves a torn checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path | None, cfg: LoopConfig) -> dict[str, Any]:
    """The checkpoint at ``path``, refused unless it was written with hyper-parameters a fresh
    run with ``cfg`` would reproduce."""
    if path is None or not path.is_file():
        raise FileNotFoundError(f"--resume given but checkpoint {path} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=False)
    check_resumable(type(cfg)(**state["train_config"]), cfg, state["step"])  # type: ignore[arg-type]
    return state


def _resume(
    checkpoint: Path | None,
    cfg: LoopConfig,
    opt: torch.optim.Optimizer,
    restore_fn: Callable[[dict[str, Any]], None],
) -> tuple[int, dict[str, Any]]:
    """Restore the trained module (``restore_fn``) and the optimizer from ``checkpoint``;
    returns the step to continue from and the log so far."""
    state = load_checkpoint(checkpoint, cfg)
    restore_fn(state)
    opt.load_state_dict(state["optimizer"])
    return state["step"], state["log"]


def _segment_clock(log: dict[str, Any]) -> Callable[[], None]:
    """A function that sets the log's ``elapsed_s`` and ``cpu_s``: the times of the earlier
    (resumed) segments already in the log plus this segment's so far."""
    t0, c0 = time.time(), time.process_time()
    base_elapsed, base_cpu = log["elapsed_s"], log["cpu_s"]

    def stamp() -> None:
        log["elapsed_s"] = base_elapsed + time.time() - t0
        log["cpu_s"] = base_cpu + time.process_time() - c0

    return stamp


def _optimizer_step(
    step_fn: StepFn,
    step: int,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    cfg: LoopConfig,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The LR of ``step``, ``step_fn``'s forward, backward, clipping and the optimizer step;
    returns ``step_fn``'s loss and log values."""
    for group in opt.param_groups:  # a group may scale the schedule (``lr_scale``)
        group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)  # type: ignore[arg-type]
    loss, values = step_fn(step)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, values


def _append(log: dict[str, Any], loss: torch.Tensor, values: dict[str, Any]) -> None:
    """Add one step's loss and log values to the log."""
    log["losses"].append(float(loss.detach()))
    for key, value in values.items():
        log[key].append(value)


def _show(bar: Any, log: dict[str, Any], extra: dict[str, str]) -> None:
    """Advance the progress bar by the step just logged."""
    bar.update(1)
    bar.set_postfix(loss=f"{log['losses'][-1]:.3f}", **extra, refresh=False)


def _save(
    checkpoint: Path,
    state_fn: Callable[[], dict[str, Any]],
    opt: torch.optim.Optimizer,
    done: int,
    log: dict[str, Any],
    cfg: LoopConfig,
) -> None:
    """Checkpoint after ``done`` steps: the trained module's entries (``state_fn``), the
    optimizer, the step, the log and the train config (``load_checkpoint`` checks it)."""
    save_checkpoint(
        checkpoint,
        {
            **state_fn(),
            "optimizer": opt.state_dict(),
            "step": done,
            "log": log,
            "train_config": asdict(cfg),  # type: ignore[call-overload]
        },
    )


def train_loop(
    step_fn: StepFn,
    opt: torch.optim.Optimizer,
    params: Iterable[torch.Tensor],
    cfg: LoopConfig,
    *,
    log_keys: Sequence[str],
    state_fn: Callable[[], dict[str, Any]],
    restore_fn: Callable[[dict[str, Any]], None],
    desc: str,
    postfix: Callable[[dict[str, Any]], dict[str, str]] | None = None,
    options: RunOptions | None = None,
) -> dict[str, Any]:
    """Run steps ``[start, cfg.steps)`` (``start`` from the checkpoint with ``options.resume``,
    else 0); returns the log (``new_log(log_keys)``) accumulated over every resumed segment.

    ``state_fn`` gives the trained module's checkpoint entries (its state dict, plus whatever a
    resume must check); the loop adds ``optimizer``, ``step``, ``log`` and ``train_config``.
    ``restore_fn`` gets a loaded checkpoint and restores (and checks) those entries.
    ``postfix`` turns a step's log values into extra progress-bar fields.
    """
    options = options or RunOptions()
    params = list(params)
    checkpoint = options.checkpoint
    log, start = new_log(log_keys), 0
    if options.resume:
        start, log = _resume(checkpoint, cfg, opt, restore_fn)
    bar = progress_bar(options.progress, cfg.steps, start, desc)
    stamp_times = _segment_clock(log)
    for step in range(start, cfg.steps):
        loss, values = _optimizer_step(step_fn, step, opt, params, cfg)
        _append(log, loss, values)
        stamp_times()
        if bar is not None:
            _show(bar, log, {} if postfix is None else postfix(values))
        done = step + 1
        stopping = stop_reached(done, options.stop_after)
        if checkpoint is not None and checkpoint_due(
            done, cfg.steps, options.checkpoint_every, stopping
        ):
            _save(checkpoint, state_fn, opt, done, log, cfg)
        if stopping:
            break
    if bar is not None:
        bar.close()
    return log
