"""Training loop of the MTP adapter: the base is frozen, only LoRA + mask embeddings learn.

One step takes ``batch_size`` greedy sequences and ``anchors_per_seq`` random anchor positions in
each sequence's generated part, lays them out with :func:`~sgl_spec.mtp.layout.training_layout`
and minimises the cross-entropy of every mask's prediction against ``x[p+j+1]``.

The sequence part is the plain base model (gate 0; anchors never see masks), so it is run once
without autograd and kept as a KV cache; only the mask tokens are forwarded with gradients,
attending to that cache through the layout's visibility rows. That is the inference situation
exactly (committed prefix in the KV cache, step tokens with a custom mask) and saves the backward
through the sequence part.

Determinism: the adapter init depends only on the seed, the batch of step ``s`` only on
``(seed, s)``; a resumed run continues bit-exactly. The loop itself (LR schedule, clipping,
checkpoints, resume checks) is the one every trainer runs (``sgl_spec.training.loop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_spec.models.build.data import batch_generator
from sgl_spec.mtp.gated_lora import MtpAdapter, MtpHandle
from sgl_spec.mtp.layout import IGNORE_INDEX, TrainingLayout, additive_mask, training_layout
from sgl_spec.training.checkpoint import ModuleCheckpoint
from sgl_spec.training.loop import RunOptions, train_loop
from sgl_spec.training.schedule import ScheduleConfig


@dataclass(frozen=True, kw_only=True)
class MtpTrainConfig(ScheduleConfig):
    """The adapter's optimisation hyper-parameters (``ScheduleConfig`` with the adapter's recipe)
    and where its anchors lie; stored in the checkpoint and checked on ``--resume``."""

    lr: float = 3e-3
    warmup_steps: int = 20
    decay_fraction: float = 0.3
    weight_decay: float = 0.0
    anchors_per_seq: int = 48
    first_anchor: int = 63  # prompt_len - 1: anchors in the target-written part only

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.anchors_per_seq <= 0 or self.first_anchor < 0:
            raise ValueError(f"anchors_per_seq must be positive, first_anchor >= 0: {self}")


def sample_step(
    data: torch.Tensor,  # [num_seqs, T] greedy sequences
    cfg: MtpTrainConfig,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [bs, T], anchors [bs, A]
    """Sequences and sorted anchor positions ``p`` in ``[first_anchor, T-3]`` (so mask 1 has a
    label); a pure function of ``(cfg.seed, step)``."""
    gen = batch_generator(cfg.seed, step)
    n, t = data.shape
    num_valid = t - 2 - cfg.first_anchor
    if num_valid <= 0:
        raise ValueError(
            f"sequences of {t} tokens leave no anchor after first_anchor={cfg.first_anchor}"
        )
    a = min(cfg.anchors_per_seq, num_valid)
    rows = torch.randint(0, n, (cfg.batch_size,), generator=gen)
    anchors = torch.stack(
        [torch.randperm(num_valid, generator=gen)[:a].sort().values for _ in range(cfg.batch_size)]
    )
    return data[rows], anchors + cfg.first_anchor


def hf_attention_mask(model: torch.nn.Module, visible: torch.Tensor) -> torch.Tensor:
    """``visible`` [bs, q, kv] as the 4D mask HF passes through unchanged: bool for sdpa,
    additive fp32 for eager attention (which adds the mask to the scores)."""
    if getattr(model.config, "_attn_implementation", "eager") == "sdpa":
        return visible[:, None]
    return additive_mask(visible)[:, None]


def mask_logits(
    model: torch.nn.Module,
    handle: MtpHandle,
    layout: TrainingLayout,
    bf16_autocast: bool = False,
) -> torch.Tensor:  # [bs, A*k, vocab] fp32, the mask part of the layout
    """Base forward of the sequence into a KV cache, then the gated mask forward on top of it."""
    t = layout.num_tokens
    device_type = layout.input_ids.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16_autocast):
        with torch.no_grad():
            cache = model(input_ids=layout.input_ids[:, :t], use_cache=True).past_key_values
        with handle.gates(layout.gate[:, t:], layout.mask_index[:, t:]):
            out = model(
                input_ids=layout.input_ids[:, t:],
                position_ids=layout.position_ids[:, t:],
                attention_mask=hf_attention_mask(model, layout.visibility[:, t:]),
                past_key_values=cache,
                use_cache=True,
            )
    return out.logits.float()


def mtp_loss(
    logits: torch.Tensor,  # [bs, A*k, vocab]
    labels: torch.Tensor,  # [bs, A*k], IGNORE_INDEX where the label is past the sequence
    k: int,
) -> tuple[torch.Tensor, list[float]]:
    """Mean cross-entropy over all labelled masks, and the mean per mask slot ``j`` (for logs)."""
    ce = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    valid = labels != IGNORE_INDEX
    per_j = []
    for j in range(k):
        v = valid[:, j::k]
        per_j.append(float(ce.detach()[:, j::k][v].mean()) if v.any() else float("nan"))
    return ce[valid].mean(), per_j


def train_adapter(
    model: torch.nn.Module,
    handle: MtpHandle,
    adapter: MtpAdapter,
    data: torch.Tensor,  # [num_seqs, T]
    cfg: MtpTrainConfig,
    mask_token_ids: Sequence[int],
    options: RunOptions | None = None,
) -> dict:
    """Run the optimizer steps; returns ``{"losses", "losses_per_j", "elapsed_s", "cpu_s"}``
    accumulated over every resumed segment. ``options``: checkpointing, resume, progress bar,
    early stop."""
    k = adapter.config.k_max
    opt = torch.optim.AdamW(
        adapter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )

    def step_fn(step: int) -> tuple[torch.Tensor, dict]:
        tokens, anchors = sample_step(data, cfg, step)
        layout = training_layout(tokens, anchors, k, mask_token_ids)
        logits = mask_logits(model, handle, layout, cfg.bf16_autocast)
        loss, per_j = mtp_loss(logits, layout.labels[:, layout.num_tokens :], k)
        return loss, {"losses_per_j": [round(x, 5) for x in per_j]}

    adapter.train()
    log = train_loop(
        step_fn,
        opt,
        adapter.parameters(),
        cfg,
        log_keys=["losses_per_j"],
        module=ModuleCheckpoint(
            entries=lambda: {"adapter": adapter.state_dict()},
            restore=lambda state: adapter.load_state_dict(state["adapter"]),
        ),
        desc="train mtp",
        postfix=lambda values: {"mask1": f"{values['losses_per_j'][0]:.3f}"},
        options=options,
    )
    adapter.eval()
    return log
