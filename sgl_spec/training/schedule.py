"""The optimisation fields every trainer's config has, the learning-rate schedule they define and
the check that a resumed run would reproduce the run it continues.

Each trainer's config (``sgl_spec.models.build.trainer.TrainConfig`` of the shipped models,
``MtpTrainConfig``, ``SpecBlockTrainConfig``) extends ``ScheduleConfig`` with its own batch-layout
fields and, where its recipe differs, its own defaults. The checkpoint stores ``asdict`` of the
config and ``check_resumable`` compares it with the config of the resuming run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Optimisation hyper-parameters shared by every trainer; stored in the checkpoint and checked
    on ``--resume``. The defaults are the shipped target's recipe; a trainer's config overrides
    what its recipe changes. Keyword-only, so a subclass's own fields can never be shifted into a
    positional slot."""

    steps: int
    batch_size: int = 8
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1  # the cosine ends at this share of ``lr``
    warmup_steps: int = 100
    decay_fraction: float = 0.25  # the cosine spans the last this share of the steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm
    seed: int = 0  # the init and every batch are functions of it
    bf16_autocast: bool = True  # forward under bf16 autocast (fp32 master weights)

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0:
            raise ValueError(f"steps and batch_size must be positive: {self}")


def decay_start(cfg: ScheduleConfig) -> int:
    """First step of the LR decay phase (the last ``decay_fraction`` of the run)."""
    return max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))


def lr_at(step: int, cfg: ScheduleConfig) -> float:
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


def check_resumable(saved: ScheduleConfig, cfg: ScheduleConfig, step: int) -> None:
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
