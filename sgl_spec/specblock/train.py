"""``python -m sgl_spec.specblock.train``: train a SpecBlock drafter for a target model.

Stages, in one command: the target's greedy continuations of train-split prompts (cached and
shared with the MTP pipeline), the reduced draft vocabulary, the drafter training (target frozen;
resumable with ``--resume``), saving the drafter (``config.json`` + ``model.safetensors``, the
format of ``SpecBlockDrafter.save_pretrained``), then the held-out α_k / τ / rank-bucket accuracy
of the *stored* drafter and the model card. Example (the shipped drafter)::

    python -m sgl_spec.specblock.train --target sgl-spec/tiny-code \\
        --out sgl_spec/models/weights/tiny-code-specblock

``--no-prefix-broadcast``, ``--no-layer-shift``, ``--no-valid-prefix`` and ``--no-rank-head``
train the Table 2 ablations (the first two and the last are stored in the drafter's config).
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import asdict
from pathlib import Path

import torch

from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.training.data import draft_vocab
from sgl_spec.specblock.training.trainer import SpecBlockTrainConfig, build_drafter, train_drafter
from sgl_spec.training import cli
from sgl_spec.training.greedy_data import DEFAULT_CACHE as GREEDY_CACHE

PROG = "python -m sgl_spec.specblock.train"
DEFAULT_SPECBLOCK_WORK = Path.home() / ".cache" / "sgl_spec" / "specblock"


def save_drafter(drafter: SpecBlockDrafter, out: Path, storage_dtype: torch.dtype) -> None:
    """``save_pretrained`` with the float weights stored as ``storage_dtype`` (loading upcasts
    to fp32; the held-out metrics are measured on exactly the stored values)."""
    copy.deepcopy(drafter).to(storage_dtype).save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; package files must be world-readable


def run(args: argparse.Namespace) -> dict:
    """Everything the CLI does; returns the training log with the held-out metrics."""
    from sgl_spec.specblock.training.card import drafter_card

    t_start = time.time()
    frozen = cli.load_frozen_target(args.target)
    target = frozen.model
    data = cli.load_greedy_splits(frozen, args, args.greedy_cache)
    drafter, coverage = new_drafter(args, target, data.train)
    cfg = train_config(args)
    log = train_and_save(args, drafter, target, data.train, cfg, coverage)
    held_out, metrics = cli.held_out_metrics(
        lambda: stored_chain_acceptance(args, target, data.eval), held_out_summary
    )
    record = training_record(args, frozen, data, coverage, drafter, cfg, log, t_start)
    message = (
        f"specblock drafter saved to {args.out}: held-out alpha {held_out['alpha']}, "
        f"tau {held_out['tau']} (command {record['command_wall_s'] / 60:.1f} min)"
    )
    return cli.write_card_and_report(args.out, record, metrics, drafter_card, message)


def trainable_parameters(drafter: SpecBlockDrafter) -> int:
    """The drafter's trained parameter count (the frozen target embedding it holds excluded)."""
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def new_drafter(
    args: argparse.Namespace, target: torch.nn.Module, train_data: torch.Tensor
) -> tuple[SpecBlockDrafter, float]:
    """A freshly initialised drafter (``--seed``) over the reduced draft vocabulary of the label
    tokens of ``train_data``; returns it with the share of label tokens that vocabulary covers."""
    d2t, coverage = draft_vocab(
        train_data, args.prompt_len, target.config.vocab_size, args.draft_vocab
    )
    drafter = build_drafter(target, d2t, seed=args.seed, **drafter_overrides(args))
    return drafter, coverage


def train_and_save(
    args: argparse.Namespace,
    drafter: SpecBlockDrafter,
    target: torch.nn.Module,
    train_data: torch.Tensor,
    cfg: SpecBlockTrainConfig,
    coverage: float,
) -> dict:
    """Train ``drafter`` on the frozen ``target`` (resumable, see ``cli.run_options``) and store
    it in ``--out``; returns the training log."""
    print(
        f"specblock: {trainable_parameters(drafter) / 1e6:.3f}M trainable params, draft vocab "
        f"{args.draft_vocab} covering {coverage:.2%} of label tokens, {train_data.shape[0]} train "
        f"sequences of {train_data.shape[1]} tokens",
        flush=True,
    )
    log = train_drafter(
        drafter,
        target,
        train_data,
        cfg,
        cli.run_options(args),
    )
    save_drafter(drafter, args.out, cli.STORAGE_DTYPES[args.storage_dtype])
    return log


def stored_chain_acceptance(
    args: argparse.Namespace, target: torch.nn.Module, eval_data: torch.Tensor
) -> dict:
    """The held-out chain acceptance of the drafter as stored in ``--out`` (its storage dtype)."""
    from sgl_spec.specblock.training.evaluate import chain_acceptance

    stored = SpecBlockDrafter.from_pretrained(args.out).eval()
    return chain_acceptance(
        stored, target, eval_data, args.prompt_len - 1, num_blocks=args.eval_blocks
    )


def training_record(
    args: argparse.Namespace,
    frozen: cli.FrozenTarget,
    data: cli.GreedySplits,
    coverage: float,
    drafter: SpecBlockDrafter,
    cfg: SpecBlockTrainConfig,
    log: dict,
    t_start: float,
) -> dict:
    """``training.json``: the run, the drafter, its data and the per-step training log."""
    times = cli.training_time_entries(log)
    return {
        "name": cli.card_name(args, "specblock"),
        "target": frozen.name,
        **cli.command_entries(PROG, args),
        "train_config": asdict(cfg),
        "drafter_config": drafter.config.to_dict(),
        "storage_dtype": args.storage_dtype,
        "data": {
            **cli.split_entries(data),
            "gen_wall_s": round(data.gen_wall_s, 1),
            "draft_vocab_coverage": round(coverage, 5),
        },
        "num_parameters": trainable_parameters(drafter),
        "target_parameters": sum(p.numel() for p in frozen.model.parameters()),
        **times,
        "s_per_step": round(log["elapsed_s"] / max(1, times["steps_done"]), 3),
        "command_wall_s": round(time.time() - t_start, 1),
        "losses": cli.rounded(log["losses"]),
        "draft_losses": cli.rounded(log["draft_losses"]),
        "rank_losses": cli.rounded(log["rank_losses"]),
        "per_slot": log["per_slot"],
        "accepted": log["accepted"],
    }


def drafter_overrides(args: argparse.Namespace) -> dict:
    """``SpecBlockConfig`` fields set by the CLI (shape and the architectural ablations)."""
    per_layer = {
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_heads,
    }
    hidden = {} if args.hidden_size is None else {"hidden_size": args.hidden_size}
    return {
        **hidden,
        "layer_overrides": {k: v for k, v in per_layer.items() if v is not None},
        "block_size": args.k,
        "num_layers": args.num_layers,
        "rank_hidden_size": args.rank_hidden,
        "prefix_broadcast": not args.no_prefix_broadcast,
        "layer_shift": not args.no_layer_shift,
        "rank_head": not args.no_rank_head,
    }


def train_config(args: argparse.Namespace) -> SpecBlockTrainConfig:
    """The optimisation config of the CLI flags (``--no-valid-prefix`` is a training ablation)."""
    return SpecBlockTrainConfig(
        **cli.schedule_fields(args),
        first_start=args.prompt_len - 1,
        num_blocks=args.num_blocks,
        rank_warmup_steps=args.rank_warmup_steps,
        shift_lr_scale=args.shift_lr_scale,
        valid_prefix=not args.no_valid_prefix,
    )


def held_out_summary(held_out: dict, eval_wall_s: float) -> dict:
    """``metrics.json``: α_k, τ and the rank-bucket accuracy at the top, the full record below."""
    rank = held_out["rank_head"]
    return {
        "alpha": held_out["alpha"],
        "tau": held_out["tau"],
        "expected_acceptance_length": held_out["expected_acceptance_length"],
        "rank_bucket_accuracy": None if rank is None else rank["accuracy"],
        "held_out": held_out,
        "eval_wall_s": round(eval_wall_s, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    p = cli.training_parser(PROG, __doc__, artifact="drafter", steps=1200, lr=1e-3)
    g = p.add_argument_group("SpecBlock drafter")
    g.add_argument("--k", type=int, default=4, help="block size K (positions per forward)")
    g.add_argument("--num-layers", type=int, default=2, help="drafter decoder layers L")
    g.add_argument(
        "--hidden-size", type=int, default=None, help="drafter width d (default: the target's)"
    )
    g.add_argument(
        "--intermediate-size", type=int, default=None, help="MLP width (default: the target's)"
    )
    g.add_argument(
        "--num-heads",
        type=int,
        default=None,
        help="attention and KV heads of the drafter layers (default: the target's; head_dim stays)",
    )
    g.add_argument("--draft-vocab", type=int, default=1024, help="reduced draft vocabulary")
    g.add_argument("--rank-hidden", type=int, default=256, help="rank head MLP width")
    g.add_argument("--num-blocks", type=int, default=2, help="blocks per training chain")
    g.add_argument("--eval-blocks", type=int, default=2, help="blocks M of a held-out chain")
    g.add_argument("--rank-warmup-steps", type=int, default=100, help="rank head joins here")
    g.add_argument(
        "--shift-lr-scale",
        type=float,
        default=1.0,
        help="learning rate of the layer-wise shift W_shift as a share of --lr",
    )
    g.add_argument("--no-prefix-broadcast", action="store_true", help="ablation (Table 2)")
    g.add_argument("--no-layer-shift", action="store_true", help="ablation (Table 2)")
    g.add_argument("--no-valid-prefix", action="store_true", help="ablation (Table 2)")
    g.add_argument("--no-rank-head", action="store_true", help="ablation (Table 2)")
    g.add_argument(
        "--greedy-cache", type=Path, default=GREEDY_CACHE, help="greedy data (shared with MTP)"
    )
    g.add_argument("--work", type=Path, default=DEFAULT_SPECBLOCK_WORK, help="checkpoints")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Entry point; sets the torch thread count before anything runs."""
    return cli.run_main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
