"""The training loop shared by the target (next-token loss) and the draft (distillation loss).

Determinism: the model init depends only on the seed (``specs.build_model``), the batch of step
``s`` only on ``(seed, s)`` (``data.batch_generator``), and there is no dropout, so two runs with
the same seed and thread count produce the same losses bit for bit, and a run resumed from a
checkpoint continues exactly as the uninterrupted run would have. Matmuls run under bf16
autocast (fp32 master weights): on this CPU that uses AMX and is several times faster than fp32.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sgl_spec.models.build.data import batch_generator, sample_batch

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation hyper-parameters; stored in the checkpoint and checked on ``--resume``."""

    steps: int
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    decay_fraction: float = 0.25
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    bf16_autocast: bool = True

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0 or self.seq_len <= 1:
            raise ValueError(f"steps, batch_size and seq_len must be positive: {self}")


def decay_start(cfg: TrainConfig) -> int:
    """First step of the LR decay phase (the last ``decay_fraction`` of the run)."""
    return max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Warm-up / stable / decay: linear warm-up, constant LR, cosine to ``min_lr_ratio * lr``.

    The constant phase is what lets a shared, unpredictably loaded machine change ``--steps`` on
    ``--resume``: until the decay starts, the LR never depends on ``steps``, so the resumed run
    is bit-identical to one launched with the new ``--steps`` from the start.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    start = decay_start(cfg)
    if step < start:
        return cfg.lr
    progress = (step - start) / max(1, cfg.steps - start)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``inputs``/``labels`` are ``[bs, seq_len]``."""
    logits = model(input_ids=inputs).logits  # [bs, seq_len, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def distill_loss(teacher: torch.nn.Module, hard_weight: float = 0.1) -> LossFn:
    """Forward KL(teacher || draft) per position, plus a little next-token loss.

    Matching the teacher's whole distribution (not only the corpus token) is what raises greedy
    agreement: the draft is rewarded for predicting what the *target* would say, which is exactly
    what speculative decoding verifies. The small hard-label term keeps it anchored to real text.
    """

    def loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
        logits = model(input_ids=inputs).logits.float()  # [bs, seq_len, vocab]
        logp = F.log_softmax(logits, dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - logp)).sum(-1).mean()
        ce = F.nll_loss(logp.flatten(0, 1), labels.flatten())
        return kl + hard_weight * ce

    return loss


def check_resumable(saved: TrainConfig, cfg: TrainConfig, step: int) -> None:
    """Refuse a resume that would not reproduce a fresh run with ``cfg``.

    Every hyper-parameter must match, except ``steps``, which may change while both schedules
    are still before their decay phase (the LRs of all steps so far are then identical).
    """
    if asdict(saved) | {"steps": cfg.steps} != asdict(cfg):
        raise ValueError(
            f"checkpoint was written with different hyper-parameters: {asdict(saved)} != {asdict(cfg)}"
        )
    if saved.steps != cfg.steps and step > min(decay_start(saved), decay_start(cfg)):
        raise ValueError(
            f"cannot change --steps from {saved.steps} to {cfg.steps} at step {step}: the "
            f"learning-rate decay has begun (decay starts at {min(decay_start(saved), decay_start(cfg))})"
        )


def _save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


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


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on norms and biases)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _resume(
    checkpoint: Path | None, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig
) -> tuple[int, list[float], float]:
    """Restore the model and optimizer from ``checkpoint``; returns the step to continue from,
    the losses so far and the training wall time already spent."""
    if checkpoint is None or not checkpoint.is_file():
        raise FileNotFoundError(f"--resume given but checkpoint {checkpoint} does not exist")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    check_resumable(TrainConfig(**{**asdict(cfg), **state["train_config"]}), cfg, state["step"])
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state["step"], list(state["losses"]), float(state.get("elapsed_s", 0.0))


def _train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    stream: torch.Tensor,
    cfg: TrainConfig,
    loss_fn: LossFn,
    step: int,
) -> float:
    """One optimizer step on the batch of ``step`` (a pure function of ``(seed, step)``)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    inputs, labels = sample_batch(
        stream, cfg.batch_size, cfg.seq_len, batch_generator(cfg.seed, step)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
        loss = loss_fn(model, inputs, labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _checkpoint_state(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    done: int,
    losses: list[float],
    cfg: TrainConfig,
    elapsed_s: float,
) -> dict:
    """What ``_resume`` restores: model, optimizer, step, losses, config and training time."""
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": done,
        "losses": losses,
        "train_config": asdict(cfg),
        "elapsed_s": elapsed_s,
    }


def train(
    model: torch.nn.Module,
    stream: torch.Tensor,  # [num_tokens]
    cfg: TrainConfig,
    loss_fn: LossFn,
    checkpoint: Path | None = None,
    resume: bool = False,
    checkpoint_every: int = 50,
    progress: bool = True,
    stop_after: int | None = None,
) -> list[float]:
    """Run ``cfg.steps`` optimizer steps; return the per-step training losses (all of them).

    ``stop_after`` ends the run early at that step with a checkpoint (a time-sliced run on a
    shared machine; ``--resume`` continues it exactly as if it had never stopped).

    With ``resume`` the model, optimizer, step and loss history are restored from ``checkpoint``;
    a checkpoint written with different hyper-parameters is refused rather than silently mixed.
    """
    opt = _optimizer(model, cfg)
    losses: list[float] = []
    start, prior_elapsed = 0, 0.0
    if resume:
        start, losses, prior_elapsed = _resume(checkpoint, model, opt, cfg)
    model.train()
    bar = progress_bar(progress, cfg.steps, start, "train")
    t0 = time.time()
    for step in range(start, cfg.steps):
        losses.append(_train_step(model, opt, stream, cfg, loss_fn, step))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr_at(step, cfg):.2e}", refresh=False)
        done = step + 1
        stopping = stop_reached(done, stop_after)
        if checkpoint is not None and checkpoint_due(done, cfg.steps, checkpoint_every, stopping):
            elapsed = prior_elapsed + time.time() - t0
            _save_checkpoint(checkpoint, _checkpoint_state(model, opt, done, losses, cfg, elapsed))
        if stopping:
            break
    if bar is not None:
        bar.close()
    model.eval()
    return losses
