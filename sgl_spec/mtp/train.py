"""``python -m sgl_spec.mtp.train``: train a gated-LoRA MTP adapter for a target model.

Stages, in one command: the target's greedy continuations of train-split prompts (cached),
the adapter training (base frozen; resumable with ``--resume``), saving the adapter, then the
held-out agreement of the *stored* adapter and the model card. Example (the shipped adapter)::

    python -m sgl_spec.mtp.train --target sgl-spec/tiny-code \\
        --out sgl_spec/models/weights/tiny-code-mtp
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import time
from pathlib import Path

import torch

from sgl_spec.models.registry import DEFAULT_TARGET, NAMESPACE, resolve_model_path
from sgl_spec.models.train import DEFAULT_WORK
from sgl_spec.mtp.adapter_io import load_adapter, save_adapter
from sgl_spec.mtp.config import BaseDims, MtpAdapterConfig
from sgl_spec.mtp.data import DEFAULT_CACHE, GreedySpec, greedy_dataset
from sgl_spec.mtp.gated_lora import MtpAdapter, attach_to_hf_model
from sgl_spec.mtp.trainer import MtpTrainConfig, train_adapter


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


def _checkpoint_path(work: Path, out: Path) -> Path:
    tag = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:8]
    return work / "checkpoints" / f"{out.name}-{tag}.ckpt"


def run(args: argparse.Namespace) -> dict:
    """Everything the CLI does; returns the training log (also written to the card)."""
    from sgl_spec.models.export import load_model_dir
    from sgl_spec.models.tokenizer import load_tokenizer
    from sgl_spec.mtp.card import write_card
    from sgl_spec.mtp.evaluate import mask_agreement

    t_start = time.time()
    target_dir = Path(resolve_model_path(args.target))
    base_name = args.target if args.target.startswith(NAMESPACE) else str(target_dir)
    model = load_model_dir(target_dir)
    for p in model.parameters():
        p.requires_grad_(False)
    tokenizer = load_tokenizer(target_dir)
    mask_ids = _mask_token_ids(tokenizer, args.k_max, args.mask_token_ids)

    train_spec = GreedySpec("train", args.num_prompts, args.prompt_len, args.num_new, args.seed)
    eval_spec = GreedySpec("eval", args.eval_prompts, args.prompt_len, args.num_new, args.seed)
    kw = {"cache_dir": args.work, "chunk": args.gen_batch, "progress": not args.no_progress}
    train_data, gen_train_s = greedy_dataset(
        model, tokenizer, target_dir, args.corpus, train_spec, **kw
    )
    eval_data, gen_eval_s = greedy_dataset(
        model, tokenizer, target_dir, args.corpus, eval_spec, **kw
    )
    gen_wall = gen_train_s + gen_eval_s

    config = MtpAdapterConfig(
        rank=args.rank,
        alpha=args.alpha,
        k_max=args.k_max,
        base_model=base_name,
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
            checkpoint=_checkpoint_path(args.work, args.out),
            resume=args.resume,
            progress=not args.no_progress,
            stop_after=args.stop_after,
        )
    storage = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.storage_dtype]
    meta = {"command": _command(args), "train_config": cfg.__dict__}
    save_adapter(args.out, adapter, config, meta, storage_dtype=storage)

    t_eval = time.time()
    stored, _ = load_adapter(args.out, model.config)
    with attach_to_hf_model(model, stored) as handle:
        held_out = mask_agreement(model, handle, eval_data, args.prompt_len - 1, mask_ids)
    metrics = held_out_summary(held_out, time.time() - t_eval)
    log = {
        "name": args.name or _default_name(args),
        "command": _command(args),
        "threads": args.threads,
        "train_config": cfg.__dict__,
        "data": {"train": train_spec.__dict__, "eval": eval_spec.__dict__, "gen_wall_s": gen_wall},
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


def _default_name(args: argparse.Namespace) -> str:
    """``<target>-mtp`` for a registered target name, else the output directory's name."""
    return f"{args.target}-mtp" if args.target.startswith(NAMESPACE) else args.out.name


def _command(args: argparse.Namespace) -> str:
    return "python -m sgl_spec.mtp.train " + shlex.join(args.argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl_spec.mtp.train", description=__doc__)
    p.add_argument("--target", default=DEFAULT_TARGET, help="registered name or model dir")
    p.add_argument("--out", type=Path, required=True, help="adapter directory to write")
    p.add_argument("--name", default=None, help="name in the model card (default: derived)")
    p.add_argument("--k-max", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    p.add_argument("--stop-after", type=int, default=None, help="stop (checkpointed) at this step")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors-per-seq", type=int, default=48)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast in training")
    p.add_argument("--num-prompts", type=int, default=896, help="train prompts")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--num-new", type=int, default=96, help="greedy tokens per prompt")
    p.add_argument("--gen-batch", type=int, default=64, help="prompts per generation batch")
    p.add_argument("--mask-token-ids", default=None, help="comma-separated; default reserved_0..")
    p.add_argument("--storage-dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--corpus", type=Path, default=DEFAULT_WORK / "corpus")
    p.add_argument(
        "--work", type=Path, default=DEFAULT_CACHE, help="cache: greedy data, checkpoints"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Entry point; sets the torch thread count before anything runs."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    return run(args)


if __name__ == "__main__":
    main()
