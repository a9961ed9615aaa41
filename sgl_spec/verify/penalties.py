"""Sampling penalties at every node of a verify tree, as plain decoding applies them.

Plain decoding penalizes the logits that choose output token j by the outputs 0..j-1: frequency
(``- f * count``), presence (``- p`` once present), repetition (a present token's logit divided
by ``r``, multiplied when negative) and ``min_new_tokens`` (stop tokens at ``-inf`` while fewer
than that many tokens are out). The additive ones come first, then the scaling one.

A verify node's logits choose the token that follows it, so its outputs so far are the request's
committed outputs (the root, the bonus token, included) plus the drafts on its path from the root.
SGLang's EAGLE verify applies one step-start penalty to every node instead, which changes the
output whenever a draft accepted earlier in the block should have been penalized; this module
computes each node's own penalty (``penalize_tree``), with ``penalize_tree_reference`` the same
thing one node at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    """One request's penalty settings (SGLang's sampling params of the same names)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # banned until min_new_tokens outputs

    @property
    def active(self) -> bool:
        return (
            self.frequency != 0.0
            or self.presence != 0.0
            or self.repetition != 1.0
            or self.min_new_tokens > 0
        )


def chain_parents(bs: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Parents of a chain of ``width`` nodes per request: [bs, width], -1 at the root."""
    return (torch.arange(width, device=device) - 1).expand(bs, width).clone()


def tree_parents(
    next_token: torch.Tensor,  # [bs, W] first child of each node, -1 if none
    next_sibling: torch.Tensor,  # [bs, W] next sibling of each node, -1 if none
) -> torch.Tensor:  # [bs, W] parent of each node, -1 at the root and for unused nodes
    """Parents from SGLang's first-child / next-sibling links (``retrieve_next_*``)."""
    bs, width = next_token.shape
    parents = torch.full_like(next_token, -1)
    owner = torch.arange(width, device=next_token.device).expand(bs, width)
    child = next_token.clone()
    rows = torch.arange(bs, device=next_token.device)[:, None].expand(bs, width)
    for _ in range(width):  # each pass moves every sibling chain one node on
        live = child >= 0
        if not bool(live.any()):
            break
        parents[rows[live], child[live]] = owner[live]
        child = torch.where(live, next_sibling.gather(1, child.clamp(min=0)), -1)
    return parents


def path_counts(
    tokens: torch.Tensor,  # [bs, W] node tokens; node 0 the root
    parents: torch.Tensor,  # [bs, W]
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node, how often each token lies on its path below the root (the node included):
    ([bs, W, vocab] counts, [bs, W] depth)."""
    bs, width = tokens.shape
    counts = torch.zeros(bs, width, vocab_size, dtype=torch.float32, device=tokens.device)
    depth = torch.zeros(bs, width, dtype=torch.long, device=tokens.device)
    node = torch.arange(width, device=tokens.device).expand(bs, width).clone()
    for _ in range(width):
        live = node > 0  # the root is committed already; -1: above the root
        if not bool(live.any()):
            break
        token = tokens.gather(1, node.clamp(min=0)).to(torch.long)
        counts.scatter_add_(2, token[..., None], live[..., None].to(torch.float32))
        depth += live.to(torch.long)
        node = torch.where(live, parents.gather(1, node.clamp(min=0)), -1)
    return counts, depth


def penalize_tree(
    logits: torch.Tensor,  # [bs * W, vocab], penalized in place
    tokens: torch.Tensor,  # [bs, W] node tokens; node 0 the root (the last committed output)
    parents: torch.Tensor,  # [bs, W] parent node, -1 at the root
    committed: list[list[int]],  # per request, its outputs so far, the root included
    penalties: list[Penalties],  # per request
) -> None:
    """Each node's penalties on its logits; requests without any are left as they are."""
    bs, width = tokens.shape
    view = logits.view(bs, width, -1)
    rows = [b for b, p in enumerate(penalties) if p.active]
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = view.index_select(0, index)  # [n, W, vocab]
    _penalize(
        sub,
        tokens.to(logits.device).index_select(0, index),
        parents.to(logits.device).index_select(0, index),
        [committed[b] for b in rows],
        [penalties[b] for b in rows],
    )
    view.index_copy_(0, index, sub)


def _penalize(
    logits: torch.Tensor,  # [n, W, vocab], in place
    tokens: torch.Tensor,  # [n, W]
    parents: torch.Tensor,  # [n, W]
    committed: list[list[int]],
    penalties: list[Penalties],
) -> None:
    vocab, dev = logits.shape[-1], logits.device
    counts, depth = path_counts(tokens, parents, vocab)
    for b, outputs in enumerate(committed):
        if outputs:
            ids = torch.tensor(outputs, dtype=torch.long, device=dev)
            counts[b] += torch.bincount(ids, minlength=vocab)[:vocab].to(torch.float32)
    present = counts > 0  # [n, W, vocab]

    def per_request(name: str) -> torch.Tensor:  # [n, 1, 1]
        values = [getattr(p, name) for p in penalties]
        return torch.tensor(values, dtype=torch.float32, device=dev)[:, None, None]

    additive = -per_request("frequency") * counts - per_request("presence") * present
    num_out = torch.tensor([len(c) for c in committed], device=dev)[:, None] + depth  # [n, W]
    for b, p in enumerate(penalties):
        if p.stop_token_ids and p.min_new_tokens > 0:
            banned = num_out[b] < p.min_new_tokens  # [W]
            stops = torch.tensor(p.stop_token_ids, dtype=torch.long, device=dev)
            additive[b, :, stops] += torch.where(banned, float("-inf"), 0.0)[:, None]
    logits += additive.to(logits.dtype)
    scale = torch.where(present, per_request("repetition"), 1.0).to(logits.dtype)
    logits.copy_(torch.where(logits < 0, logits * scale, logits / scale))


def penalize_tree_reference(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    committed: list[list[int]],
    penalties: list[Penalties],
) -> None:
    """``penalize_tree`` node by node: walk up to the root, then apply each penalty."""
    bs, width = tokens.shape
    view = logits.view(bs, width, -1)
    for b in range(bs):
        p = penalties[b]
        for i in range(width):
            path, node = [], i
            while node > 0:
                path.append(int(tokens[b, node]))
                node = int(parents[b, node])
            outputs = committed[b] + path[::-1]
            row = view[b, i]
            for t in set(outputs):
                row[t] -= p.frequency * outputs.count(t) + p.presence
            if len(outputs) < p.min_new_tokens:
                for t in p.stop_token_ids:
                    row[t] = float("-inf")
            for t in set(outputs):
                row[t] = row[t] * p.repetition if row[t] < 0 else row[t] / p.repetition
