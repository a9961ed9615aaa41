"""Training loop of the SpecBlock drafter (paper §3.3, §4.1, App. A.1).

One step takes ``batch_size`` target-written sequences, recomputes the frozen target's
low/mid/top features for them (``data.aux_hidden_states``) and runs every chain of the
sequence's generated part (``layout``): pass 1 drafts a block from every position at once, then
each chain is continued for ``num_blocks - 1`` more blocks from a uniformly drawn cut (§3.3
cross-block training). The objective is Eq. (7) under the valid-prefix mask (``losses``); the
rank head joins after ``rank_warmup_steps`` (§4.1 enables it after 2,000 steps, once the trunk's
distribution is stable).

Determinism: the drafter init depends only on the seed, a step's sequences and cuts only on
``(seed, step)``; a resumed run continues bit-exactly. The loop itself (LR schedule, clipping,
checkpoints, resume checks) is the one every trainer runs (``sgl_spec.training.loop``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_spec.models.build.data import batch_generator
from sgl_spec.specblock.config import SpecBlockConfig
from sgl_spec.specblock.layout import (
    block_labels,
    chain_attention_mask,
    chain_offsets,
    gather_slot,
    sample_cuts,
)
from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.training.data import aux_hidden_states
from sgl_spec.specblock.training.losses import LossBreakdown, chain_loss, target_to_draft_map
from sgl_spec.training.checkpoint import ModuleCheckpoint
from sgl_spec.training.loop import RunOptions, train_loop
from sgl_spec.training.schedule import ScheduleConfig


@dataclass(frozen=True, kw_only=True)
class SpecBlockTrainConfig(ScheduleConfig):
    """The drafter's optimisation hyper-parameters (``ScheduleConfig`` with the drafter's recipe:
    PyTorch's default AdamW betas and the paper's gradient clip of 0.5, §4.1, App. A.1) and its
    chain layout; stored in the checkpoint and checked on ``--resume``. ``batch_size`` counts
    sequences; every chain of each is trained."""

    lr: float = 1e-3
    warmup_steps: int = 20
    decay_fraction: float = 0.3
    weight_decay: float = 0.01
    grad_clip: float = 0.5
    first_start: int = 63  # prompt_len - 1: chains start in the target-written part only
    num_blocks: int = 2  # M blocks per training chain (cross-block training, §3.3)
    rank_warmup_steps: int = 100
    # W_shift's learning rate as a share of ``lr``: the shift sits on the residual stream itself
    # (Eq. 3 replaces it between layers), so Adam's per-element steps there scramble every
    # position's state, where the same steps inside a normalised residual branch do not
    shift_lr_scale: float = 1.0
    valid_prefix: bool = True  # False: the Table 2 "- valid-prefix curriculum" ablation

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_blocks <= 0 or self.first_start < 0:
            raise ValueError(f"num_blocks must be positive, first_start >= 0: {self}")
        if not self.shift_lr_scale > 0:
            raise ValueError(f"shift_lr_scale must be > 0, got {self.shift_lr_scale}")
        if self.rank_warmup_steps < 0:
            raise ValueError(f"rank_warmup_steps must be >= 0, got {self.rank_warmup_steps}")


def build_drafter(
    target: torch.nn.Module,
    d2t: torch.Tensor,  # [V_d] target id of each draft id
    *,
    seed: int = 0,
    **config: object,
) -> SpecBlockDrafter:
    """A fresh drafter for ``target`` (App. A.1: same hidden size and layer design, the target's
    embedding copied in and frozen); ``config`` overrides ``SpecBlockConfig`` fields (``block_size``,
    ``num_layers``, ``prefix_broadcast``, ``layer_shift``, ``rank_head``, ...)."""
    cfg = SpecBlockConfig.from_target(target.config, draft_vocab_size=d2t.numel(), **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = SpecBlockDrafter(cfg)
    drafter.set_target_embedding(target.get_input_embeddings().weight)
    drafter.set_draft_vocab(d2t)
    return drafter


@dataclass
class ChainOutput:
    """Every block of every chain: block ``m`` is entry ``m`` of each list."""

    logits: list[torch.Tensor]  # [bs, C, K, V_d]
    rank_logits: list[torch.Tensor | None]  # [bs, C, K, 4]
    labels: list[torch.Tensor]  # [bs, C, K] target ids, IGNORE_INDEX past the sequence
    positions: list[torch.Tensor]  # [bs, C] start position of the block


def chain_forward(
    drafter: SpecBlockDrafter,
    features: torch.Tensor,  # [bs, T, 3*d_target] target features at every position
    tokens: torch.Tensor,  # [bs, T]
    chain_starts: torch.Tensor,  # [C] increasing start positions of the chains
    cuts: torch.Tensor,  # [bs, C, M-1] 1-based cut at each boundary
    draft_tokens: bool = False,
) -> ChainOutput:
    """Pass 1 over positions ``0..max(chain_starts)``, then blocks ``2..M`` of every chain.

    A later block starts at ``start + cut`` and takes the token there: the ground truth
    ``x[start + cut]`` in training (§3.3), or with ``draft_tokens`` the drafter's own argmax at
    the cut slot (inference, Algorithm 2 line 9).
    """
    k = drafter.config.block_size
    bs, t = tokens.shape
    num_starts = int(chain_starts.max()) + 1
    first = drafter(features[:, :num_starts], tokens[:, :num_starts])
    starts = chain_starts.to(tokens.device).expand(bs, -1)  # [bs, C]
    logits, hidden = first.logits[:, chain_starts], first.hidden[:, chain_starts]
    rank = None if first.rank_logits is None else first.rank_logits[:, chain_starts]
    out = ChainOutput([logits], [rank], [block_labels(tokens, starts, k)], [starts])
    context = list(first.kv)
    offsets = chain_offsets(cuts)  # [bs, C, M]
    for m in range(1, offsets.shape[-1]):
        cut = cuts[..., m - 1]
        positions = starts + offsets[..., m]
        if draft_tokens:
            ids = drafter.d2t[gather_slot(logits, cut).argmax(-1)]
        else:
            ids = tokens.gather(1, positions.clamp(max=t - 1))
        block = drafter(
            gather_slot(hidden, cut),
            ids,
            from_draft=True,
            positions=positions,
            context_kv=context,
            attention_mask=chain_attention_mask(k, num_starts, chain_starts, cuts[..., :m]),
        )
        logits, hidden = block.logits, block.hidden
        out.logits.append(logits)
        out.rank_logits.append(block.rank_logits)
        out.labels.append(block_labels(tokens, positions, k))
        out.positions.append(positions)
        context = [
            (torch.cat([ck, nk], dim=2), torch.cat([cv, nv], dim=2))
            for (ck, cv), (nk, nv) in zip(context, block.kv, strict=True)
        ]
    return out


def sample_step(
    data: torch.Tensor,  # [num_seqs, T]
    cfg: SpecBlockTrainConfig,
    block_size: int,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [bs, T], starts [C], cuts
    """A step's sequences, chain starts (every position of the generated part that has a label)
    and cuts ``[bs, C, M-1]``; a pure function of ``(cfg.seed, step)``."""
    n, t = data.shape
    if t - 1 <= cfg.first_start:
        raise ValueError(f"sequences of {t} tokens leave no chain after {cfg.first_start}")
    gen = batch_generator(cfg.seed, step)
    rows = torch.randint(0, n, (cfg.batch_size,), generator=gen)
    starts = torch.arange(cfg.first_start, t - 1)
    cuts = sample_cuts(cfg.batch_size, starts.numel(), cfg.num_blocks, block_size, gen)
    return data[rows], starts, cuts


def step_loss(
    drafter: SpecBlockDrafter,
    target: torch.nn.Module,
    tokens: torch.Tensor,  # [bs, T]
    starts: torch.Tensor,  # [C]
    cuts: torch.Tensor,  # [bs, C, M-1]
    cfg: SpecBlockTrainConfig,
    step: int,
) -> LossBreakdown:
    """Eq. (7) for one batch: target features (frozen, fp32), the chain forward, the losses."""
    features = aux_hidden_states(target, tokens, drafter.config.aux_layer_ids)
    device_type = tokens.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
        out = chain_forward(drafter, features, tokens, starts, cuts)
    t2d = target_to_draft_map(drafter.d2t, drafter.config.target_vocab_size)
    use_rank = step >= cfg.rank_warmup_steps
    return chain_loss(
        out.logits, out.rank_logits, out.labels, t2d, cuts, cfg.valid_prefix, use_rank
    )


def _rounded(rows: list[list[float]]) -> list[list[float | None]]:
    """JSON-safe per-slot values: NaN (no position admitted) becomes None."""
    return [[None if math.isnan(x) else round(x, 4) for x in row] for row in rows]


def _check_drafter(state: dict, drafter: SpecBlockDrafter, path: Path | None) -> None:
    if state["drafter_config"] != drafter.config.to_dict():
        raise ValueError(
            f"checkpoint {path} holds a different drafter: {state['drafter_config']} != "
            f"{drafter.config.to_dict()}"
        )


def train_drafter(
    drafter: SpecBlockDrafter,
    target: torch.nn.Module,
    data: torch.Tensor,  # [num_seqs, T] prompt + greedy continuation
    cfg: SpecBlockTrainConfig,
    options: RunOptions | None = None,
) -> dict:
    """Run the optimizer steps; returns the log (``losses``, ``draft_losses``, ``rank_losses``,
    ``per_slot`` / ``accepted`` ``[M][K]`` per step, ``elapsed_s``, ``cpu_s``) accumulated over
    every resumed segment. ``options``: checkpointing, resume, progress bar, early stop."""
    options = options or RunOptions()
    params = [p for p in drafter.parameters() if p.requires_grad]
    shift_ids = {id(p) for p in drafter.shifts.parameters()}
    groups = [
        {"params": [p for p in params if id(p) not in shift_ids], "lr_scale": 1.0},
        {"params": [p for p in params if id(p) in shift_ids], "lr_scale": cfg.shift_lr_scale},
    ]
    opt = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    k, device = drafter.config.block_size, drafter.d2t.device

    def step_fn(step: int) -> tuple[torch.Tensor, dict]:
        tokens, starts, cuts = (x.to(device) for x in sample_step(data, cfg, k, step))
        losses = step_loss(drafter, target, tokens, starts, cuts, cfg, step)
        return losses.total, {
            "draft_losses": float(losses.draft.detach()),
            "rank_losses": None if losses.rank is None else float(losses.rank.detach()),
            "per_slot": _rounded(losses.per_slot),
            "accepted": _rounded(losses.accepted),
        }

    def restore(state: dict) -> None:
        _check_drafter(state, drafter, options.checkpoint)
        drafter.load_state_dict(state["drafter"])

    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    drafter.train()
    log = train_loop(
        step_fn,
        opt,
        params,
        cfg,
        log_keys=["draft_losses", "rank_losses", "per_slot", "accepted"],
        module=ModuleCheckpoint(
            entries=lambda: {
                "drafter": drafter.state_dict(),
                "drafter_config": drafter.config.to_dict(),
            },
            restore=restore,
        ),
        desc="train specblock",
        options=options,
    )
    drafter.eval()
    return log
