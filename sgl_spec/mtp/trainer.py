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
``(seed, s)``; a resumed run continues bit-exactly. The LR schedule and the resume checks are the
ones of the shipped models' trainer (``sgl_spec.models.trainer``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sgl_spec.models.data import batch_generator
from sgl_spec.models.trainer import check_resumable, lr_at
from sgl_spec.mtp.gated_lora import MtpAdapter, MtpHandle
from sgl_spec.mtp.layout import IGNORE_INDEX, TrainingLayout, additive_mask, training_layout


@dataclass(frozen=True)
class MtpTrainConfig:
    """Optimisation hyper-parameters; stored in the checkpoint and checked on ``--resume``.

    Field names match ``sgl_spec.models.trainer.TrainConfig`` where they mean the same, so its
    ``lr_at`` (warm-up / constant / cosine) and ``check_resumable`` apply unchanged.
    """

    steps: int
    batch_size: int = 8
    anchors_per_seq: int = 48
    first_anchor: int = 63  # prompt_len - 1: anchors in the target-written part only
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    decay_fraction: float = 0.3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    bf16_autocast: bool = True

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.anchors_per_seq) <= 0 or self.first_anchor < 0:
            raise ValueError(
                f"steps, batch_size, anchors_per_seq must be positive, first_anchor >= 0: {self}"
            )


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


def _save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_adapter(
    model: torch.nn.Module,
    handle: MtpHandle,
    adapter: MtpAdapter,
    data: torch.Tensor,  # [num_seqs, T]
    cfg: MtpTrainConfig,
    mask_token_ids: Sequence[int],
    checkpoint: Path | None = None,
    resume: bool = False,
    checkpoint_every: int = 25,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Run the optimizer steps; returns ``{"losses", "losses_per_j", "elapsed_s", "cpu_s"}``
    accumulated over every resumed segment."""
    k = adapter.config.k_max
    opt = torch.optim.AdamW(
        adapter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    log: dict = {"losses": [], "losses_per_j": [], "elapsed_s": 0.0, "cpu_s": 0.0}
    start = 0
    if resume:
        if checkpoint is None or not checkpoint.is_file():
            raise FileNotFoundError(f"--resume given but checkpoint {checkpoint} does not exist")
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        check_resumable(MtpTrainConfig(**state["train_config"]), cfg, state["step"])
        adapter.load_state_dict(state["adapter"])
        opt.load_state_dict(state["optimizer"])
        start, log = state["step"], state["log"]
    adapter.train()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="train mtp", mininterval=5.0)
    t0, c0 = time.time(), time.process_time()
    base_elapsed, base_cpu = log["elapsed_s"], log["cpu_s"]
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)  # type: ignore[arg-type]
        tokens, anchors = sample_step(data, cfg, step)
        layout = training_layout(tokens, anchors, k, mask_token_ids)
        logits = mask_logits(model, handle, layout, cfg.bf16_autocast)
        loss, per_j = mtp_loss(logits, layout.labels[:, layout.num_tokens :], k)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log["losses"].append(float(loss.detach()))
        log["losses_per_j"].append([round(x, 5) for x in per_j])
        log["elapsed_s"] = base_elapsed + time.time() - t0
        log["cpu_s"] = base_cpu + time.process_time() - c0
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{log['losses'][-1]:.3f}", mask1=f"{per_j[0]:.3f}", refresh=False)
        done = step + 1
        stopping = stop_after is not None and done >= stop_after
        if checkpoint is not None and (
            done % checkpoint_every == 0 or done == cfg.steps or stopping
        ):
            _save(
                checkpoint,
                {
                    "adapter": adapter.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": done,
                    "log": log,
                    "train_config": asdict(cfg),
                },
            )
        if stopping:
            break
    if bar is not None:
        bar.close()
    adapter.eval()
    return log
