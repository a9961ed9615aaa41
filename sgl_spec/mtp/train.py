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
from sgl_spec.mtp.trainer import MtpTrainConfig, train_adapter
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
    from sgl_spec.models.tokenizer import RESERVED_TOKENS

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
    from sgl_spec.mtp.card import write_card
    from sgl_spec.mtp.evaluate import mask_agreement

    t_start = time.time()
    target = cli.load_frozen_target(args.target)
    model = target.model
    mask_ids = _mask_token_ids(target.tokenizer, args.k_max, args.mask_token_ids)
    data = cli.load_greedy_splits(target, args, args.work)
    train_data, eval_data, gen_wall = data.train, data.eval, data.gen_wall_s

    config = MtpAdapterConfig(
        rank=args.rank,
        alpha=args.alpha,
        k_max=args.k_max,
        base_model=target.name,
        mask_token_ids=mask_ids,
    )
    adapter = MtpAdapter(config, BaseDims.from_hf_config(model.config))
    adapter.reset_parameters(
        model.get_input_embeddings().weight, torch.Generator().manual_seed(args.seed)
    )
    cfg = MtpTrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        anchors_per_seq=args.anchors_per_seq,
        first_anchor=args.prompt_len - 1,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        bf16_autocast=not args.fp32,
    )
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
        args.out, adapter, config, meta, storage_dtype=cli.STORAGE_DTYPES[args.storage_dtype]
    )

    t_eval = time.time()
    stored, _ = load_adapter(args.out, model.config)
    with attach_to_hf_model(model, stored) as handle:
        held_out = mask_agreement(model, handle, eval_data, args.prompt_len - 1, mask_ids)
    metrics = held_out_summary(held_out, time.time() - t_eval)
    log = {
        "name": args.name or cli.default_name(args, "mtp"),
        "command": cli.reproduce_command(PROG, args),
        "threads": args.threads,
        "train_config": cfg.__dict__,
        "data": {
            "train": data.train_spec.__dict__,
            "eval": data.eval_spec.__dict__,
            "gen_wall_s": gen_wall,
        },
        "num_parameters": adapter.num_parameters(),
        "base_parameters": sum(p.numel() for p in model.parameters()),
        "steps_done": len(log["losses"]),
        "train_wall_s": round(log["elapsed_s"], 1),
        "train_cpu_s": round(log["cpu_s"], 1),
        "command_wall_s": round(time.time() - t_start, 1),
        "gen_wall_s": round(gen_wall, 1),
        "losses": [round(x, 5) for x in log["losses"]],
        "losses_per_j": log["losses_per_j"],
    }
    write_card(args.out, log, metrics)
    print(
        f"mtp adapter saved to {args.out}: held-out mask_correct {held_out['mask_correct']}, "
        f"prefix_correct {held_out['prefix_correct']} (command {log['command_wall_s'] / 60:.1f} min)",
        flush=True,
    )
    return {**log, "metrics": metrics}


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
