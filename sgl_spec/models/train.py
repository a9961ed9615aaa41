"""``python -m sgl_spec.models.train``: the offline pipeline behind the shipped default models.

Stages, each a subcommand, each reading the previous one's output from ``--work`` (a cache dir,
never the git tree): ``corpus`` -> ``tokenizer`` -> ``target`` -> ``draft`` -> ``eval`` (metrics
and model cards). ``all`` runs them in order. Every stage is deterministic given ``--seed`` and
``--threads``; ``target`` and ``draft`` resume from their checkpoint with ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

from sgl_spec.models.build import corpus, specs, tokenizer
from sgl_spec.models.build.data import cached_stream
from sgl_spec.models.build.trainer import TrainConfig, distill_loss, lm_loss, train
from sgl_spec.models.registry import SHIPPED_MODELS

DEFAULT_WORK = Path.home() / ".cache" / "sgl_spec" / "tiny-code"
DEFAULT_TARGET_OUT = SHIPPED_MODELS["sgl-spec/tiny-code"]
DEFAULT_DRAFT_OUT = SHIPPED_MODELS["sgl-spec/tiny-code-draft"]
TRAINING_LOG = "training.json"


def _command() -> str:
    return "python -m sgl_spec.models.train " + shlex.join(sys.argv[1:])


def _streams(work: Path) -> tuple[object, torch.Tensor]:
    tok = tokenizer.load_tokenizer(work / "tokenizer")
    texts = corpus.load_split(work / "corpus", "train")
    return tok, cached_stream(tok, texts, work / "tokenizer" / "tokens_train.npy")


def cmd_corpus(args: argparse.Namespace) -> None:
    """Build the corpus and its manifest."""
    manifest = corpus.build_corpus(args.work / "corpus", args.stdlib)
    print(
        f"corpus: {manifest['num_files']} files, {manifest['num_bytes']} bytes, sha256 {manifest['total_sha256']}"
    )


def cmd_tokenizer(args: argparse.Namespace) -> None:
    """Train the BPE on the train split only (held-out files stay unseen)."""
    texts = corpus.load_split(args.work / "corpus", "train")
    out = args.work / "tokenizer"
    for stale in out.glob("tokens_*.npy"):
        stale.unlink()
    tokenizer.train_tokenizer(texts, args.vocab_size, out)
    tok = tokenizer.load_tokenizer(out)
    print(f"tokenizer: {len(tok)} tokens -> {out}")


def _train_config(args: argparse.Namespace) -> TrainConfig:
    """The recipe's fields that the command line sets (steps, batch size, window, lr, warm-up,
    seed); the rest keep ``TrainConfig``'s defaults."""
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    return TrainConfig(**given)


def _write_training_log(
    out: Path, role: str, cfg: TrainConfig, losses: list[float], wall_s: float, args, extra: dict
) -> None:
    manifest = corpus.load_manifest(args.work / "corpus")
    log = {
        "role": role,
        "command": _command(),
        "threads": args.threads,
        "train_config": cfg.__dict__,
        "wall_s": round(wall_s, 1),
        "steps_done": len(losses),
        "tokens_seen": len(losses) * cfg.batch_size * cfg.seq_len,
        "corpus_sha256": manifest["total_sha256"],
        "corpus_python": manifest["python_version"],
        "losses": [round(x, 5) for x in losses],
        **extra,
    }
    (out / TRAINING_LOG).write_text(json.dumps(log, indent=1) + "\n")


def _checkpoint_wall_s(path: Path, fallback: float) -> float:
    """Total training wall time across resumed segments, as stored in the checkpoint."""
    if not path.is_file():
        return fallback
    return float(
        torch.load(path, map_location="cpu", weights_only=False).get("elapsed_s", fallback)
    )


def _storage_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def cmd_target(args: argparse.Namespace) -> None:
    """Train the target from scratch on the corpus with the next-token loss."""
    tok, stream = _streams(args.work)
    ids = tokenizer.special_token_ids(tok)
    model = specs.build_model(specs.PRESETS[args.preset], len(tok), tok.eos_token_id, args.seed)
    cfg = _train_config(args)
    print(
        f"target: {specs.count_parameters(model) / 1e6:.2f}M params, {stream.numel()} train tokens"
    )
    ckpt = args.work / f"{args.preset}-target.ckpt"
    t0 = time.time()
    losses = train(model, stream, cfg, lm_loss, ckpt, args.resume, stop_after=args.stop_after)
    wall = _checkpoint_wall_s(ckpt, time.time() - t0)
    _export(model, args, ids)
    _write_training_log(args.out, "target", cfg, losses, wall, args, {"preset": args.preset})
    print(f"target saved to {args.out} ({wall:.0f}s of training)")


def _export(model: torch.nn.Module, args: argparse.Namespace, ids: dict) -> None:
    """Write ``model`` as an HF model dir with the shared tokenizer (target and draft alike)."""
    from sgl_spec.models.build.export import save_model_dir

    save_model_dir(
        model,
        args.out,
        args.work / "tokenizer",
        _storage_dtype(args.storage_dtype),
        [ids[tokenizer.IM_END]],
    )


def init_draft_from_target(draft: torch.nn.Module, target: torch.nn.Module) -> None:
    """Start the draft from the target: at the target's width, its embeddings, final norm and
    first ``n`` layers (a truncated, early-exit target that distillation only has to adapt);
    narrower, the target's embeddings projected onto their leading singular directions.

    The projection keeps what the tied output matrix can tell apart: with E = U S V^T and a
    draft embedding E V_d, a draft state V_d^T h scores tokens as E V_d V_d^T h, the target's
    scores of h's part in the embeddings' strongest directions. The layers start untrained.
    """
    width = draft.config.hidden_size
    if width != target.config.hidden_size:
        if not (draft.config.tie_word_embeddings and target.config.tie_word_embeddings):
            raise ValueError("a narrower draft is initialised with tied embeddings only")
        embed = target.model.embed_tokens.weight.detach().float()
        _, _, vh = torch.linalg.svd(embed, full_matrices=False)
        with torch.no_grad():
            draft.model.embed_tokens.weight.copy_(embed @ vh[:width].T)
        return
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    if not draft.config.tie_word_embeddings:
        draft.lm_head.load_state_dict(target.lm_head.state_dict())
    for i, layer in enumerate(draft.model.layers):
        layer.load_state_dict(target.model.layers[i].state_dict())


def cmd_draft(args: argparse.Namespace) -> None:
    """Distil the draft from the target's logits on the corpus."""
    from sgl_spec.models.build.export import load_model_dir

    tok, stream = _streams(args.work)
    ids = tokenizer.special_token_ids(tok)
    target = load_model_dir(args.target)
    for p in target.parameters():
        p.requires_grad_(False)
    model = specs.build_model(specs.PRESETS[args.preset], len(tok), tok.eos_token_id, args.seed)
    init_draft_from_target(model, target)
    cfg = _train_config(args)
    print(f"draft: {specs.count_parameters(model) / 1e6:.2f}M params, distilled from {args.target}")
    ckpt = args.work / f"{args.preset}-draft.ckpt"
    t0 = time.time()
    losses = train(
        model, stream, cfg, distill_loss(target), ckpt, args.resume, stop_after=args.stop_after
    )
    wall = _checkpoint_wall_s(ckpt, time.time() - t0)
    _export(model, args, ids)
    _write_training_log(
        args.out,
        "draft",
        cfg,
        losses,
        wall,
        args,
        {"preset": args.preset, "teacher": str(args.target)},
    )
    print(f"draft saved to {args.out} ({wall:.0f}s of training)")


def cmd_eval(args: argparse.Namespace) -> None:
    """Held-out metrics and timings, then the model cards of both directories."""
    from sgl_spec.models.build.card import write_cards
    from sgl_spec.models.build.evaluate import evaluate_pair

    tok = tokenizer.load_tokenizer(args.work / "tokenizer")
    eval_stream = cached_stream(
        tok,
        corpus.load_split(args.work / "corpus", "eval"),
        args.work / "tokenizer" / "tokens_eval.npy",
    )
    metrics = evaluate_pair(
        args.target,
        args.draft,
        eval_stream,
        num_prompts=args.num_prompts,
        max_windows=args.max_windows,
        timing_threads=args.timing_threads,
    )
    metrics["eval_command"] = _command()
    write_cards(args.target, args.draft, metrics, corpus.load_manifest(args.work / "corpus"))
    print(json.dumps({k: v for k, v in metrics.items() if k != "timing"}, indent=1))


def cmd_all(args: argparse.Namespace) -> None:
    """Every stage in order, with the defaults of each (the recipe of the shipped models)."""
    cmd_corpus(args)
    cmd_tokenizer(args)
    cmd_target(_with(args, steps=args.target_steps, out=args.target))
    # the draft stage's --steps, --lr, ... are `all`'s --draft-steps, --draft-lr, ...
    recipe = {name: getattr(args, f"draft_{name}") for name in ("steps", "lr", "warmup_steps")}
    cmd_draft(_with(args, **recipe, preset=args.draft_preset, out=args.draft))
    cmd_eval(args)


def _with(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


# Recipe of the shipped models: (steps, lr, warm-up steps) per role.
TARGET_RECIPE = (333, 1.5e-3, 100)
DRAFT_RECIPE = (240, 1e-3, 20)


def _add_train_flags(
    p: argparse.ArgumentParser, recipe: tuple[int, float, int] | None, preset: str
) -> None:
    steps, lr, warmup = recipe or TARGET_RECIPE
    if recipe is not None:
        p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup-steps", type=int, default=warmup)
    p.add_argument("--preset", choices=sorted(specs.PRESETS), default=preset)
    p.add_argument("--storage-dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop at this step (checkpointed) and export anyway; the card states the steps done",
    )


def build_parser() -> argparse.ArgumentParser:
    """The CLI; every flag has a default that reproduces the shipped models."""
    parser = argparse.ArgumentParser(prog="python -m sgl_spec.models.train", description=__doc__)
    parser.add_argument(
        "--work",
        type=Path,
        default=DEFAULT_WORK,
        help="cache dir for corpus, tokenizer, checkpoints",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 leaves a core free)"
    )
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("corpus", help="build corpus + manifest from the stdlib")
    p.add_argument(
        "--stdlib", type=Path, default=None, help="stdlib dir (default: this interpreter's)"
    )
    p.set_defaults(func=cmd_corpus)
    p = sub.add_parser("tokenizer", help="train the byte-level BPE")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.set_defaults(func=cmd_tokenizer)
    p = sub.add_parser("target", help="train the target model")
    _add_train_flags(p, TARGET_RECIPE, "target")
    p.add_argument("--out", type=Path, default=DEFAULT_TARGET_OUT)
    p.set_defaults(func=cmd_target)
    p = sub.add_parser("draft", help="distil the draft model from the target")
    _add_train_flags(p, DRAFT_RECIPE, "draft")
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET_OUT)
    p.add_argument("--out", type=Path, default=DEFAULT_DRAFT_OUT)
    p.set_defaults(func=cmd_draft)
    for name, func in (("eval", cmd_eval), ("all", cmd_all)):
        p = sub.add_parser(
            name, help="held-out metrics + model cards" if name == "eval" else "all stages"
        )
        p.add_argument("--target", type=Path, default=DEFAULT_TARGET_OUT)
        p.add_argument("--draft", type=Path, default=DEFAULT_DRAFT_OUT)
        p.add_argument("--num-prompts", type=int, default=64)
        p.add_argument(
            "--max-windows", type=int, default=128, help="held-out windows of 512 tokens"
        )
        p.add_argument("--timing-threads", type=str, default="1,2")
        if name == "all":
            p.add_argument("--stdlib", type=Path, default=None)
            p.add_argument("--vocab-size", type=int, default=4096)
            p.add_argument("--target-steps", type=int, default=TARGET_RECIPE[0])
            p.add_argument("--draft-steps", type=int, default=DRAFT_RECIPE[0])
            p.add_argument("--draft-lr", type=float, default=DRAFT_RECIPE[1])
            p.add_argument("--draft-warmup-steps", type=int, default=DRAFT_RECIPE[2])
            p.add_argument("--draft-preset", choices=sorted(specs.PRESETS), default="draft")
            _add_train_flags(p, None, "target")
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point; sets the thread count first so every stage honours ``--threads``."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    args.func(args)


if __name__ == "__main__":
    main()
