"""STANDALONE_FULL's draft on a hot vocabulary: SGLang's ``--speculative-token-map``.

SGLang loads the map (a ``torch.save``'d list of token ids) into the draft worker's
``hot_token_id`` and maps every draft proposal through it (``draft_forward``), but its
STANDALONE draft worker never shrinks the draft model's head (``init_lm_head`` is a no-op), so
the full-vocabulary proposals would be read as hot indices. Here the draft's LM head keeps only
the hot rows (a copy: a tied input embedding stays whole), so each draft forward multiplies by
``len(map)`` rows instead of the vocabulary, and its logits, top-k and probabilities are over
hot indices, SGLang's convention for carried proposals.

Verification stays exact: the target checks every draft token, so greedy output and the
sampled law are the target's (SGLang 0.5.23 verifies STANDALONE's sampled drafts target-only:
it refuses ``--speculative-use-rejection-sampling`` for it). Were rejection sampling to serve
it, the verify would read the draft's distribution q over the target's vocabulary:
``full_vocab`` puts the hot probabilities at their token ids and 0 elsewhere, the distribution
the drafts were drawn from (a token outside the map is never drafted, and the residual
max(p - q, 0) resamples it with the target's probability).

``python -m sgl_spec.standalone.hot_vocab --model DIR --size N --out FILE`` writes the ``N``
most frequent token ids of the training corpus's train split (``sgl_spec.models.build``).
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)
FLAG = "--speculative-token-map"


class HotHead(nn.Module):
    """An LM head of the hot rows only: what SGLang's ``LogitsProcessor`` multiplies by."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


def check_map(hot: torch.Tensor, vocab: int) -> torch.Tensor:
    """The map as a 1-D int64 tensor of distinct ids in ``[0, vocab)``; ValueError naming the
    flag otherwise."""
    if hot.dim() != 1 or hot.numel() == 0 or hot.is_floating_point():
        raise ValueError(f"{FLAG}: expected a non-empty list of token ids, got {tuple(hot.shape)}")
    hot = hot.to(torch.int64)
    if int(hot.min()) < 0 or int(hot.max()) >= vocab:
        raise ValueError(f"{FLAG}: token ids must lie in [0, {vocab}) (the draft's vocabulary)")
    if hot.unique().numel() != hot.numel():
        raise ValueError(f"{FLAG}: token ids must be distinct")
    return hot


def install(worker: Any) -> None:
    """Give the draft model of ``worker`` (a draft worker with ``hot_token_id`` and
    ``draft_runner``) a head of the map's rows; nothing without a map."""
    hot = getattr(worker, "hot_token_id", None)
    if hot is None:
        return
    model = worker.draft_runner.model
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{FLAG}: the draft model {type(model).__name__} has no plain LM head")
    hot = check_map(hot, weight.shape[0]).to(weight.device)
    worker.hot_token_id = hot
    model.lm_head = HotHead(weight.detach()[hot].clone())
    logger.info("STANDALONE_FULL: draft LM head on %d of %d tokens (%s)", hot.numel(),
                weight.shape[0], FLAG)  # fmt: skip


def full_vocab(probs: torch.Tensor | None, hot: torch.Tensor | None, vocab: int):
    """``probs`` [..., len(hot)] over hot indices -> [..., vocab] over token ids (0 outside
    the map); as given without a map or without probabilities."""
    if probs is None or hot is None or probs.shape[-1] == vocab:
        return probs
    out = probs.new_zeros((*probs.shape[:-1], vocab))
    out[..., hot] = probs
    return out


# ---- building a map ------------------------------------------------------------------------------


def corpus_counts(model_dir: str) -> Counter:
    """Token counts of the training corpus's train split under ``model_dir``'s tokenizer."""
    from transformers import AutoTokenizer

    from sgl_spec.models.build.corpus import read_corpus

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    entries, texts = read_corpus()
    counts: Counter = Counter()
    for entry in entries:
        if entry.split == "train":
            counts.update(tokenizer(texts[entry.path], add_special_tokens=False)["input_ids"])
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sgl_spec.standalone.hot_vocab")
    p.add_argument("--model", required=True, help="the draft model (a shipped name or directory)")
    p.add_argument("--size", type=int, required=True, help="token ids to keep")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from sgl_spec.models.registry import resolve_model_path

    model_dir = resolve_model_path(args.model)
    counts = corpus_counts(model_dir)
    hot = [token for token, _ in counts.most_common(args.size)]
    total = sum(counts.values())
    covered = sum(counts[t] for t in hot)
    torch.save(hot, args.out)
    Path(args.out).chmod(0o644)
    print(f"{len(hot)} ids cover {covered / total:.4f} of {total} train-split tokens -> {args.out}")


if __name__ == "__main__":
    main()
