"""The optimisation loop of the adapter and drafter trainers (``sgl_spec.mtp.trainer``,
``sgl_spec.specblock.trainer``).

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

from sgl_spec.models.trainer import check_resumable, lr_at

StepFn = Callable[[int], tuple[torch.Tensor, dict[str, Any]]]
"""``step -> (loss, {log key: value of this step})``; the loop backpropagates the loss."""


class LoopConfig(Protocol):
    """The fields the loop reads; a frozen dataclass whose names match
    ``sgl_spec.models.trainer.TrainConfig`` (so ``lr_at`` and ``check_resumable`` apply)."""

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
    checkpoint, stop_after = options.checkpoint, options.stop_after
    log, start = new_log(log_keys), 0
    if options.resume:
        state = load_checkpoint(checkpoint, cfg)
        restore_fn(state)
        opt.load_state_dict(state["optimizer"])
        start, log = state["step"], state["log"]
    bar = None
    if options.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=desc, mininterval=5.0)
    t0, c0 = time.time(), time.process_time()
    base_elapsed, base_cpu = log["elapsed_s"], log["cpu_s"]
    for step in range(start, cfg.steps):
        for group in opt.param_groups:  # a group may scale the schedule (``lr_scale``)
            group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)  # type: ignore[arg-type]
        loss, values = step_fn(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log["losses"].append(float(loss.detach()))
        for key, value in values.items():
            log[key].append(value)
        log["elapsed_s"] = base_elapsed + time.time() - t0
        log["cpu_s"] = base_cpu + time.process_time() - c0
        if bar is not None:
            extra = {} if postfix is None else postfix(values)
            bar.update(1)
            bar.set_postfix(loss=f"{log['losses'][-1]:.3f}", **extra, refresh=False)
        done = step + 1
        stopping = stop_after is not None and done >= stop_after
        if checkpoint is not None and (
            done % options.checkpoint_every == 0 or done == cfg.steps or stopping
        ):
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
        if stopping:
            break
    if bar is not None:
        bar.close()
    return log
