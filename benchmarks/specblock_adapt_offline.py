"""The learning half of SPECBLOCK's adaptation (paper §3.4), isolated from serving: how the
held-out acceptance length of the drafter moves as ``adapt/update.py`` updates it on an
out-of-domain stream.

The stream is ``bench_specblock_adapt``'s natural-language prompts (the drafter was trained on
Python code). The target writes each prompt's greedy continuation; the first ``--held-out``
sequences are held out, the rest form the stream. Per stream query the training windows are cut
as the serving adapter cuts them (``window + K`` committed positions, the newest
``max_examples_per_query`` kept); every ``buffer_queries`` queries one update of ``--action``
runs (``DrafterCopies.update``: ``steps_per_update`` AdamW steps of the draft + rank loss with
the KL penalty to the shipped weights) and is synced. Every ``--eval-every`` updates the
held-out greedy-chain tau (``evaluate.chain_acceptance``, M = 2 blocks) is printed.

No bandit and no serving: this measures whether the update objective itself moves tau, with
the ``AdaptConfig`` the server would use (``--adapt-options`` as for ``--specblock-adapt-options``).

    python benchmarks/specblock_adapt_offline.py --num-queries 96 --action full --json OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_specblock_adapt import build_stream

from sgl_spec.models.build.evaluate import greedy_continuation
from sgl_spec.models.registry import resolve_model_path
from sgl_spec.specblock.adapt.policy import Action, AdaptConfig
from sgl_spec.specblock.adapt.update import (
    DrafterCopies,
    TrainExample,
    cut_windows,
)
from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.training.data import aux_hidden_states
from sgl_spec.specblock.training.evaluate import chain_acceptance
from sgl_spec.training.cli import load_frozen_target


def query_examples(
    features: torch.Tensor,  # [T, F] target features of one sequence
    tokens: torch.Tensor,  # [T]
    first: int,  # first committed position (prompt_len - 1)
    cfg: AdaptConfig,
    block_size: int,
) -> list[TrainExample]:
    """The windows the serving adapter cuts from one query's committed positions."""
    windows, _ = cut_windows(features[first:], tokens[first:], cfg.window, block_size)
    return windows[-cfg.max_examples_per_query :]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="sgl-spec/tiny-code")
    p.add_argument("--drafter", default="sgl-spec/tiny-code-specblock")
    p.add_argument("--num-queries", type=int, default=96, help="stream queries")
    p.add_argument("--held-out", type=int, default=16, help="held-out sequences")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="target tokens per query")
    p.add_argument("--action", choices=[a.value for a in (Action.HEAD, Action.FULL)])
    p.add_argument("--adapt-options", default=None, help="as --specblock-adapt-options")
    p.add_argument("--eval-every", type=int, default=4, help="updates between evaluations")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.action is None:
        p.error("--action is required (head or full)")
    sizes = (args.num_queries, args.held_out, args.prompt_len, args.new_tokens, args.eval_every)
    if min(sizes) < 1:
        p.error("sizes must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = AdaptConfig.parse(args.adapt_options)
    frozen = load_frozen_target(args.target)
    target, tokenizer = frozen.model, frozen.tokenizer
    texts = build_stream(args.num_queries + args.held_out, 600, seed=1)
    ids = [x[: args.prompt_len] for x in (tokenizer.encode(t) for t in texts)]
    ids = [x for x in ids if len(x) == args.prompt_len]
    if len(ids) <= args.held_out:
        raise SystemExit(f"only {len(ids)} prompts of {args.prompt_len} tokens")
    prompts = torch.tensor(ids)
    seqs = torch.cat([prompts, greedy_continuation(target, prompts, args.new_tokens)], 1)
    held, stream = seqs[: args.held_out], seqs[args.held_out :]
    drafter = SpecBlockDrafter.from_pretrained(resolve_model_path(args.drafter)).eval()
    copies = DrafterCopies(drafter, cfg)
    first = args.prompt_len - 1
    features = aux_hidden_states(target, stream, drafter.config.aux_layer_ids)

    def tau() -> float:
        return chain_acceptance(copies.inf, target, held, first, num_blocks=2)["tau"]

    rows = [{"updates": 0, "queries": 0, "tau": tau(), "loss": None, "update_s": None}]
    print(f"{stream.shape[0]} stream queries, {held.shape[0]} held out; tau {rows[0]['tau']}")
    action, buffer, updates = Action(args.action), [], 0
    block = drafter.config.block_size
    for q in range(stream.shape[0]):
        buffer += query_examples(features[q], stream[q], first, cfg, block)
        if (q + 1) % cfg.buffer_queries:
            continue
        tic = time.perf_counter()
        loss = copies.update(action, buffer)
        copies.sync(block=True)
        elapsed, buffer, updates = time.perf_counter() - tic, [], updates + 1
        if updates % args.eval_every == 0:
            row = {"updates": updates, "queries": q + 1, "tau": tau(), "loss": loss}
            rows.append({**row, "update_s": round(elapsed, 3)})
            print(
                f"after {updates} updates ({q + 1} queries): tau {row['tau']}"
                f" (loss {loss:.3f}, update {elapsed:.2f}s)",
                flush=True,
            )
    if args.json:
        doc = {"command": " ".join(sys.argv), "adapt_config": cfg.__dict__, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
