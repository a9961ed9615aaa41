"""Training of the shipped target (next-token loss) and draft (distillation loss): the config,
the two losses, the optimizer, the batches and the checkpoint layout; the loop itself (LR
schedule, backward, clip, optimizer step, checkpoints, resume checks) is ``sgl_spec.training.loop``.

Determinism: the model init depends only on the seed (``specs.build_model``), the batch of step
``s`` only on ``(seed, s)`` (``data.batch_generator``), and there is no dropout, so two runs with
the same seed and thread count produce the same losses bit for bit, and a run resumed from a
checkpoint continues exactly as the uninterrupted run would have. Matmuls run under bf16
autocast (fp32 master weights): on this CPU that uses AMX and is several times faster than fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sgl_spec.models.build.data import batch_generator, sample_batch
from sgl_spec.training.checkpoint import Log, LogLayout, ModuleCheckpoint
from sgl_spec.training.loop import RunOptions, train_loop
from sgl_spec.training.schedule import ScheduleConfig

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class TrainConfig(ScheduleConfig):
    """The shipped models' optimisation hyper-parameters (``ScheduleConfig``'s defaults are their
    recipe) and the length of a training window; stored in the checkpoint, checked on
    ``--resume``."""

    seq_len: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seq_len <= 1:
            raise ValueError(f"seq_len must be > 1: {self}")


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


def _read_log(state: dict[str, Any]) -> Log:
    """The log of a checkpoint that keeps ``losses`` and ``elapsed_s`` only (CPU time is not
    stored: it restarts at the resumed segment)."""
    return {
        "losses": list(state["losses"]),
        "elapsed_s": float(state.get("elapsed_s", 0.0)),
        "cpu_s": 0.0,
    }


FLAT_LOG = LogLayout(
    entries=lambda log: {"losses": log["losses"], "elapsed_s": log["elapsed_s"]}, read=_read_log
)
"""The checkpoint layout of the shipped models' runs: ``losses`` and the training wall time
``elapsed_s`` (which ``sgl_spec.models.train`` reads for the card) as entries of their own."""


def model_checkpoint(model: torch.nn.Module) -> ModuleCheckpoint:
    """The model's state dict under ``model``, the log laid out by ``FLAT_LOG``."""
    return ModuleCheckpoint(
        entries=lambda: {"model": model.state_dict()},
        restore=lambda state: model.load_state_dict(state["model"]),
        log_layout=FLAT_LOG,
    )


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

    def step_fn(step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss on the batch of ``step`` (a pure function of ``(seed, step)``)."""
        inputs, labels = sample_batch(
            stream, cfg.batch_size, cfg.seq_len, batch_generator(cfg.seed, step)
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            return loss_fn(model, inputs, labels), {}

    model.train()
    log = train_loop(
        step_fn,
        opt,
        model.parameters(),
        cfg,
        log_keys=[],
        module=model_checkpoint(model),
        desc="train",
        options=RunOptions(checkpoint, resume, checkpoint_every, progress, stop_after),
    )
    model.eval()
    return log["losses"]
