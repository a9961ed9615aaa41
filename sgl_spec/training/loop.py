"""The optimisation loop of every trainer: the shipped target and draft
(``sgl_spec.models.build.trainer``), the MTP adapter and the SpecBlock drafter.

A trainer brings one step: ``step_fn(step)`` draws the batch of ``step`` (a pure function of
``(seed, step)``), runs the forward and returns the loss and that step's log values. The rest is
the same for all and lives here, in this order per step: the LR of the step (``lr_at``: warm-up /
constant / cosine), ``step_fn``, backward, gradient clipping, the optimizer step, ``zero_grad``;
then wall and CPU time accumulated across resumed segments, the progress bar, and checkpoints
every ``checkpoint_every`` steps, at the last step and at ``stop_after`` (a time-sliced run on a
shared machine).

Why a resumed run continues bit-exactly: the checkpoint (``sgl_spec.training.checkpoint``) holds
the trained module's entries, the optimizer, the step, the log and the train config; a resume
with different hyper-parameters is refused (``check_resumable``) rather than silently mixed, and
the batches depend only on ``(seed, step)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgl_spec.training.checkpoint import (
    Log,
    ModuleCheckpoint,
    checkpoint_state,
    resume,
    save_checkpoint,
)
from sgl_spec.training.schedule import ScheduleConfig, lr_at

StepFn = Callable[[int], tuple[torch.Tensor, dict[str, Any]]]
"""``step -> (loss, {log key: value of this step})``; the loop backpropagates the loss."""


@dataclass(frozen=True)
class RunOptions:
    """How a run is driven, as opposed to what it optimises: none of this is in the train config,
    so changing it never blocks a resume."""

    checkpoint: Path | None = None  # where the run is checkpointed (None: not at all)
    resume: bool = False  # continue from ``checkpoint``
    checkpoint_every: int = 25
    progress: bool = True  # tqdm bar
    stop_after: int | None = None  # stop, checkpointed, once this many steps are done


def new_log(keys: Sequence[str]) -> Log:
    """The empty log: ``losses``, one list per key of the step's log values, then the times."""
    return {"losses": [], **{key: [] for key in keys}, "elapsed_s": 0.0, "cpu_s": 0.0}


def progress_bar(enabled: bool, total: int, initial: int, desc: str) -> Any:
    """A tqdm bar over the run's steps starting at ``initial`` (a resumed run), or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, mininterval=5.0)


def stop_reached(done: int, stop_after: int | None) -> bool:
    """Whether a time-sliced run (``stop_after``) ends after ``done`` steps."""
    return stop_after is not None and done >= stop_after


def checkpoint_due(done: int, steps: int, every: int, stopping: bool) -> bool:
    """Checkpoint every ``every`` steps, at the last step and where a time-sliced run stops."""
    return done % every == 0 or done == steps or stopping


def _segment_clock(log: Log) -> Callable[[], None]:
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
    cfg: ScheduleConfig,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The LR of ``step``, ``step_fn``'s forward, backward, clipping and the optimizer step;
    returns ``step_fn``'s loss and log values."""
    for group in opt.param_groups:  # a group may scale the schedule (``lr_scale``)
        group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)
    loss, values = step_fn(step)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, values


def _append(log: Log, loss: torch.Tensor, values: dict[str, Any]) -> None:
    """Add one step's loss and log values to the log."""
    log["losses"].append(float(loss.detach()))
    for key, value in values.items():
        log[key].append(value)


def _show(bar: Any, log: Log, lr: float, extra: dict[str, str]) -> None:
    """Advance the progress bar by the step just logged."""
    bar.update(1)
    bar.set_postfix(loss=f"{log['losses'][-1]:.3f}", lr=f"{lr:.2e}", **extra, refresh=False)


def train_loop(
    step_fn: StepFn,
    opt: torch.optim.Optimizer,
    params: Iterable[torch.Tensor],
    cfg: ScheduleConfig,
    *,
    log_keys: Sequence[str],
    module: ModuleCheckpoint,
    desc: str,
    postfix: Callable[[dict[str, Any]], dict[str, str]] | None = None,
    options: RunOptions | None = None,
) -> Log:
    """Run steps ``[start, cfg.steps)`` (``start`` from the checkpoint with ``options.resume``,
    else 0); returns the log (``new_log(log_keys)``) accumulated over every resumed segment.

    ``module`` says what the checkpoint holds of the trained module and where it keeps the log;
    ``postfix`` turns a step's log values into extra progress-bar fields.
    """
    options = options or RunOptions()
    params = list(params)
    checkpoint = options.checkpoint
    log, start = new_log(log_keys), 0
    if options.resume:
        start, log = resume(checkpoint, cfg, opt, module)
    bar = progress_bar(options.progress, cfg.steps, start, desc)
    stamp_times = _segment_clock(log)
    for step in range(start, cfg.steps):
        loss, values = _optimizer_step(step_fn, step, opt, params, cfg)
        _append(log, loss, values)
        stamp_times()
        if bar is not None:
            _show(bar, log, lr_at(step, cfg), {} if postfix is None else postfix(values))
        done = step + 1
        stopping = stop_reached(done, options.stop_after)
        if checkpoint is not None and checkpoint_due(
            done, cfg.steps, options.checkpoint_every, stopping
        ):
            save_checkpoint(checkpoint, checkpoint_state(module, opt, done, log, cfg))
        if stopping:
            break
    if bar is not None:
        bar.close()
    return log
