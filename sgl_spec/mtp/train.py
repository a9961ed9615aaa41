"""``python -m sgl_spec.mtp.train``: train a gated-LoRA MTP adapter for a target model.

Stages, in one command: the target's greedy continuations of train-split prompts (cached),
the adapter training (base frozen; resumable with ``--resume``), saving the adapter, then the
held-out agreement of the *stored* adapter and the model card. Example (the shipped adapter)::

    python -m sgl_spec.mtp.train --target sgl-spec/tiny-code \\
        --out sgl_spec/models/weights/tiny-code-mtp
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from sgl_spec.mtp.adapter_io import load_adapter, save_adapter
from sgl_spec.mtp.config import BaseDims, MtpAdapterConfig
from sgl_spec.mtp.gated_lora import MtpAdapter, attach_to_hf_model
from sgl_spec.mtp.training.trainer import MtpTrainConfig, train_adapter
from sgl_spec.training import cli
from sgl_spec.training.greedy_data import DEFAULT_CACHE

PROG = "python -m sgl_spec.mtp.train"


def _mask_token_ids(tokenizer, k_max: int, explicit: str | None) -> tuple[int, ...]:
    """``--mask-token-ids`` if given, else the tokenizer's ``<|reserved_0..k_max-1|>``."""
    if explicit:
        ids = tuple(int(x) for x in explicit.split(",") if x.strip())
        if len(ids) != k_max:
            raise SystemExit(f"--mask-token-ids needs {k_max} ids (--k-max), got {list(ids)}")
        return ids
    from sgl_spec.models.build.tokenizer import RESERVED_TOKENS

    ids = []
    for tok in RESERVED_TOKENS[:k_max]:
        i = tokenizer.convert_tokens_to_ids(tok)
        if i is None or i == tokenizer.unk_token_id:
            raise SystemExit(
                f"tokenizer has no {tok!r} for a mask slot; pass --mask-token-ids with {k_max} ids"
            )
        ids.append(int(i))
    if len(ids) < k_max:
        raise SystemExit(f"only {len(ids)} reserved tokens exist; pass --mask-token-ids")
    return tuple(ids)


def run(args: argparse.Namespace) -> dict:
    """Everything the CLI does; returns the training log (also written to the card)."""
    from sgl_spec.mtp.training.card import adapter_card

    t_start = time.time()
    target = cli.load_frozen_target(args.target)
    mask_ids = _mask_token_ids(target.tokenizer, args.k_max, args.mask_token_ids)
    data = cli.load_greedy_splits(target, args, args.work)
    adapter = new_adapter(args, target, mask_ids)
    cfg = train_config(args)
    log = train_and_save(args, target.model, adapter, data.train, cfg)
    held_out, metrics = cli.held_out_metrics(
        lambda: stored_agreement(args.out, target.model, data.eval, args.prompt_len - 1, mask_ids),
        held_out_summary,
    )
    record = training_record(args, cfg, data, adapter, target.model, log, t_start)
    message = (
        f"mtp adapter saved to {args.out}: held-out mask_correct {held_out['mask_correct']}, "
        f"prefix_correct {held_out['prefix_correct']} (command {record['command_wall_s'] / 60:.1f} min)"
    )
    return cli.write_card_and_report(args.out, record, metrics, adapter_card, message)


def new_adapter(
    args: argparse.Namespace, target: cli.FrozenTarget, mask_ids: tuple[int, ...]
) -> MtpAdapter:
    """A freshly initialised adapter of the CLI's shape for ``target`` (init from ``--seed``)."""
    config = MtpAdapterConfig(
        rank=args.rank,
        alpha=args.alpha,
        k_max=args.k_max,
        base_model=target.name,
        mask_token_ids=mask_ids,
    )
    model = target.model
    adapter = MtpAdapter(config, BaseDims.from_hf_config(model.config))
    adapter.reset_parameters(
        model.get_input_embeddings().weight, torch.Generator().manual_seed(args.seed)
    )
    return adapter


def train_config(args: argparse.Namespace) -> MtpTrainConfig:
    """The optimisation config of the CLI flags (anchors start at the last prompt token)."""
    return MtpTrainConfig(
        **cli.schedule_fields(args),
        anchors_per_seq=args.anchors_per_seq,
        first_anchor=args.prompt_len - 1,
    )


def train_and_save(
    args: argparse.Namespace,
    model: torch.nn.Module,
    adapter: MtpAdapter,
    train_data: torch.Tensor,
    cfg: MtpTrainConfig,
) -> dict:
    """Train ``adapter`` on the frozen ``model`` (resumable, see ``cli.run_options``) and store it
    in ``--out``; returns the training log."""
    mask_ids = adapter.config.mask_token_ids
    print(
        f"mtp: {adapter.num_parameters() / 1e6:.3f}M adapter params, {train_data.shape[0]} train "
        f"sequences of {train_data.shape[1]} tokens, mask tokens {list(mask_ids)}",
        flush=True,
    )
    with attach_to_hf_model(model, adapter) as handle:
        log = train_adapter(
            model,
            handle,
            adapter,
            train_data,
            cfg,
            mask_ids,
            cli.run_options(args),
        )
    meta = {"command": cli.reproduce_command(PROG, args), "train_config": cfg.__dict__}
    save_adapter(
        args.out,
        adapter,
        adapter.config,
        meta,
        storage_dtype=cli.STORAGE_DTYPES[args.storage_dtype],
    )
    return log


def stored_agreement(
    out: Path,
    model: torch.nn.Module,
    eval_data: torch.Tensor,
    first_anchor: int,
    mask_ids: tuple[int, ...],
) -> dict:
    """The held-out mask agreement of the adapter as stored in ``out`` (its storage dtype)."""
    from sgl_spec.mtp.training.evaluate import mask_agreement

    stored, _ = load_adapter(out, model.config)
    with attach_to_hf_model(model, stored) as handle:
        return mask_agreement(model, handle, eval_data, first_anchor, mask_ids)


def training_record(
    args: argparse.Namespace,
    cfg: MtpTrainConfig,
    data: cli.GreedySplits,
    adapter: MtpAdapter,
    model: torch.nn.Module,
    log: dict,
    t_start: float,
) -> dict:
    """``training.json``: the run, its data and the per-step training log."""
    return {
        "name": cli.card_name(args, "mtp"),
        **cli.command_entries(PROG, args),
        "train_config": cfg.__dict__,
        "data": {**cli.split_entries(data), "gen_wall_s": data.gen_wall_s},
        "num_parameters": adapter.num_parameters(),
        "base_parameters": sum(p.numel() for p in model.parameters()),
        **cli.training_time_entries(log),
        "command_wall_s": round(time.time() - t_start, 1),
        "gen_wall_s": round(data.gen_wall_s, 1),
        "losses": cli.rounded(log["losses"]),
        "losses_per_j": log["losses_per_j"],
    }


def held_out_summary(held_out: dict, eval_wall_s: float) -> dict:
    """``metrics.json``: the rates under the names the serving side reads (``alpha_prefix`` =
    P(masks 1..j all correct), ``alpha_mask``, ``alpha_conditional``), plus the full record."""
    return {
        "alpha_prefix": held_out["prefix_correct"],
        "alpha_mask": held_out["mask_correct"],
        "alpha_conditional": held_out["conditional"],
        "expected_acceptance_length": held_out["expected_acceptance_length"],
        "held_out": held_out,
        "eval_wall_s": round(eval_wall_s, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    p = cli.training_parser(PROG, __doc__, artifact="adapter", steps=450, lr=3e-3)
    g = p.add_argument_group("MTP adapter")
    g.add_argument("--k-max", type=int, default=4)
    g.add_argument("--rank", type=int, default=16)
    g.add_argument("--alpha", type=float, default=32.0)
    g.add_argument("--anchors-per-seq", type=int, default=48)
    g.add_argument("--mask-token-ids", default=None, help="comma-separated; default reserved_0..")
    g.add_argument(
        "--work", type=Path, default=DEFAULT_CACHE, help="cache: greedy data, checkpoints"
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    """Entry point; sets the torch thread count before anything runs."""
    return cli.run_main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
