"""The command-line scaffolding of the MTP adapter and SpecBlock drafter training CLIs
(``python -m sgl_spec.mtp.train``, ``python -m sgl_spec.specblock.train``).

Both train a small module on a frozen target's own greedy continuations, so they share the run's
flags (same names, meanings and defaults unless a CLI passes its own) and the train-config fields
those set, the frozen target, the train/eval greedy data, the card name, the reproduce command,
where the resumable checkpoint lives, the timed held-out evaluation of the stored module, the
entries of ``training.json`` both write and the closing card-and-report step. Each CLI adds its
own flags in its own argument group and keeps its own ``run``, which lays out its
``training.json`` from these entries.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sgl_spec.models.registry import DEFAULT_TARGET, NAMESPACE, resolve_model_path
from sgl_spec.models.train import DEFAULT_WORK
from sgl_spec.training.card import ModuleCard, write_card_files
from sgl_spec.training.greedy_data import GreedySpec, greedy_dataset
from sgl_spec.training.loop import RunOptions

STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""``--storage-dtype``: the dtype of the float weights on disk (loading upcasts to fp32)."""


def training_parser(
    prog: str, description: str, *, artifact: str, steps: int, lr: float
) -> argparse.ArgumentParser:
    """A parser with the flags every training CLI has; ``artifact`` names what ``--out`` holds,
    ``steps`` and ``lr`` are the CLI's defaults."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="registered name or model dir")
    p.add_argument("--out", type=Path, required=True, help=f"{artifact} directory to write")
    p.add_argument("--name", default=None, help="name in the model card (default: derived)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    p.add_argument("--stop-after", type=int, default=None, help="stop (checkpointed) at this step")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast in training")
    p.add_argument("--num-prompts", type=int, default=896, help="train prompts")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--num-new", type=int, default=96, help="greedy tokens per prompt")
    p.add_argument("--gen-batch", type=int, default=64, help="prompts per generation batch")
    p.add_argument("--storage-dtype", choices=sorted(STORAGE_DTYPES), default="bf16")
    p.add_argument("--corpus", type=Path, default=DEFAULT_WORK / "corpus")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    return p


def run_main(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], dict],
    argv: list[str] | None,
) -> dict:
    """Parse, keep the exact argv for the reproduce command and set the torch thread count before
    anything runs (timings and bf16 results depend on it)."""
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    return run(args)


def schedule_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ScheduleConfig`` fields the shared flags set (``--fp32`` turns bf16 autocast off);
    a CLI's train config adds its own fields and keeps its recipe's defaults for the rest."""
    return {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "seed": args.seed,
        "bf16_autocast": not args.fp32,
    }


def reproduce_command(prog: str, args: argparse.Namespace) -> str:
    """The command line as given, for the card's "Reproduce" section."""
    return f"{prog} {shlex.join(args.argv)}"


def default_name(args: argparse.Namespace, suffix: str) -> str:
    """``<target>-<suffix>`` for a registered target name, else the output directory's name."""
    return f"{args.target}-{suffix}" if args.target.startswith(NAMESPACE) else args.out.name


def card_name(args: argparse.Namespace, suffix: str) -> str:
    """``--name``, else ``default_name``."""
    return args.name or default_name(args, suffix)


def checkpoint_path(work: Path, out: Path) -> Path:
    """One checkpoint per output directory (its name plus a hash of its absolute path), so runs
    into different directories never resume each other."""
    tag = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:8]
    return work / "checkpoints" / f"{out.name}-{tag}.ckpt"


def run_options(args: argparse.Namespace) -> RunOptions:
    """``--resume``, ``--stop-after`` and ``--no-progress``, checkpointing into ``--work``."""
    return RunOptions(
        checkpoint=checkpoint_path(args.work, args.out),
        resume=args.resume,
        progress=not args.no_progress,
        stop_after=args.stop_after,
    )


@dataclass
class FrozenTarget:
    """The target a module is trained for, its weights frozen."""

    path: Path  # resolved model directory
    name: str  # as the card states it: the registered name as given, else ``path``
    model: torch.nn.Module
    tokenizer: Any


def load_frozen_target(target: str) -> FrozenTarget:
    """``--target`` (registered name or model dir) loaded in fp32 with ``requires_grad`` off."""
    from sgl_spec.models.build.export import load_model_dir
    from sgl_spec.models.build.tokenizer import load_tokenizer

    path = Path(resolve_model_path(target))
    model = load_model_dir(path)
    for p in model.parameters():
        p.requires_grad_(False)
    name = target if target.startswith(NAMESPACE) else str(path)
    return FrozenTarget(path, name, model, load_tokenizer(path))


@dataclass
class GreedySplits:
    """The target's greedy continuations of train-split and held-out prompts."""

    train_spec: GreedySpec
    eval_spec: GreedySpec
    train: torch.Tensor  # [num_prompts, prompt_len + num_new]
    eval: torch.Tensor  # [eval_prompts, prompt_len + num_new]
    gen_wall_s: float  # generation time of both (the cached part included)


def load_greedy_splits(
    target: FrozenTarget, args: argparse.Namespace, cache_dir: Path
) -> GreedySplits:
    """Both splits from the cache in ``cache_dir``, generating what is missing."""
    train_spec = GreedySpec("train", args.num_prompts, args.prompt_len, args.num_new, args.seed)
    eval_spec = GreedySpec("eval", args.eval_prompts, args.prompt_len, args.num_new, args.seed)
    kw = {"cache_dir": cache_dir, "chunk": args.gen_batch, "progress": not args.no_progress}
    common = (target.model, target.tokenizer, target.path, args.corpus)
    train, gen_train_s = greedy_dataset(*common, train_spec, **kw)
    held_out, gen_eval_s = greedy_dataset(*common, eval_spec, **kw)
    return GreedySplits(train_spec, eval_spec, train, held_out, gen_train_s + gen_eval_s)


def held_out_metrics(
    evaluate: Callable[[], dict], summarize: Callable[[dict, float], dict]
) -> tuple[dict, dict]:
    """``evaluate()`` (loading the module as stored, then its held-out evaluation: the metrics
    are of exactly the stored values) and ``summarize(record, eval_wall_s)``, the card's
    ``metrics.json``; returns both."""
    t_eval = time.time()
    held_out = evaluate()
    return held_out, summarize(held_out, time.time() - t_eval)


def command_entries(prog: str, args: argparse.Namespace) -> dict:
    """``training.json``'s ``command`` (the reproduce command) and ``threads``."""
    return {"command": reproduce_command(prog, args), "threads": args.threads}


def split_entries(data: GreedySplits) -> dict:
    """The ``train`` and ``eval`` specs of ``training.json``'s ``data``."""
    return {"train": asdict(data.train_spec), "eval": asdict(data.eval_spec)}


def training_time_entries(log: dict) -> dict:
    """``steps_done`` and the training's wall and CPU time (every resumed segment) of a
    ``train_loop`` log."""
    return {
        "steps_done": len(log["losses"]),
        "train_wall_s": round(log["elapsed_s"], 1),
        "train_cpu_s": round(log["cpu_s"], 1),
    }


def rounded(values: Iterable[float | None]) -> list[float | None]:
    """Per-step losses for ``training.json`` (5 decimals; None, a step without that loss, kept)."""
    return [None if x is None else round(x, 5) for x in values]


def write_card_and_report(
    out: Path,
    record: dict,
    metrics: dict,
    card: Callable[[Path, dict, dict], ModuleCard],
    message: str,
) -> dict:
    """The card into ``out`` (``training.json``, ``metrics.json``, plot and the README that
    ``card(out, record, metrics)`` says), then ``message``; returns the record with the metrics,
    what ``main`` returns."""
    write_card_files(out, record, metrics, card)
    print(message, flush=True)
    return {**record, "metrics": metrics}
