"""Held-out draft quality of a SpecBlock drafter against its target (paper App. C, Table 3).

Along the target's own greedy continuation ``x`` of a held-out prompt, every position ``p`` of
the generated part with ``K*M`` labels after it starts a greedy chain of ``M`` blocks: block 1
conditions on the target's features at ``p``, block ``m+1`` on the drafter's own state at the
last slot of block ``m`` with the token it drafted there (App. C: "block 1 additionally assumes
block 0 was fully accepted"). Chain position ``k`` is right when its argmax is ``x[p+k]``.

- ``alpha[k]``: P(position k right | positions 1..k-1 right), App. C's α_k for k = 1..K·M;
- ``prefix_correct[k]``: P(positions 1..k all right);
- ``expected_acceptance_length[k]``: ``1 + Σ_{j≤k} prefix_correct[j]``, tokens per verifier
  call (bonus included) for a chain of k drafts from a uniformly spread start;
- ``tau``: acceptance length (accepted drafts + the bonus token) per verifier call when
  greedy decoding is replayed along each sequence with chains of depth K·M;
- rank head (Table 3): on the positions the valid-prefix mask admits (all earlier chain
  positions right), the accuracy of the predicted bucket, and per bucket its frequency,
  precision and recall.

The chain rates are ``sgl_spec.training.acceptance``'s. Everything runs in fp32, with the block
layout of training (``trainer.chain_forward``), which equals block-by-block inference (see the
tests).
"""

from __future__ import annotations

import torch

from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.rank import NUM_BUCKETS
from sgl_spec.specblock.training.data import aux_hidden_states
from sgl_spec.specblock.training.losses import bucket_labels, target_to_draft_map, to_draft_ids
from sgl_spec.specblock.training.trainer import chain_forward
from sgl_spec.training.acceptance import prefix_hits, prefix_rates


def chain_rates(correct: torch.Tensor) -> dict:  # correct: [num_chains, depth] bool
    """``alpha``, ``prefix_correct`` and ``expected_acceptance_length`` (module docstring)."""
    rates = prefix_rates(correct)
    return {
        "alpha": rates["conditional"],
        "prefix_correct": rates["prefix_correct"],
        "expected_acceptance_length": rates["expected_acceptance_length"],
    }


def replay_tau(correct: torch.Tensor) -> tuple[int, int]:  # correct: [n, C, depth] bool
    """Greedy decoding replayed along each sequence: from chain ``i`` the verifier accepts the
    leading right drafts ``a`` plus the bonus token, and the next chain starts at ``i + a + 1``.
    Returns (tokens committed, verifier calls); ``tau`` is their ratio."""
    accepted = prefix_hits(correct).sum(-1).tolist()  # [n, C]
    tokens = calls = 0
    for row in accepted:
        i = 0
        while i < len(row):
            tokens += row[i] + 1
            calls += 1
            i += row[i] + 1
    return tokens, calls


def bucket_report(
    predicted: torch.Tensor,  # [N] predicted bucket at valid-prefix positions
    actual: torch.Tensor,  # [N] bucket of the target token's rank there
) -> dict:
    """Accuracy and per-bucket frequency / precision / recall (Table 3's columns)."""
    n = actual.numel()
    rows = []
    for b in range(NUM_BUCKETS):
        hit = int(((predicted == b) & (actual == b)).sum())
        said, true = int((predicted == b).sum()), int((actual == b).sum())
        rows.append(
            {
                "bucket": b,
                "frequency": round(true / n, 4) if n else 0.0,
                "precision": round(hit / said, 4) if said else None,
                "recall": round(hit / true, 4) if true else None,
            }
        )
    accuracy = float((predicted == actual).float().mean()) if n else 0.0
    return {"accuracy": round(accuracy, 4), "num_positions": n, "buckets": rows}


@torch.no_grad()
def chain_acceptance(
    drafter: SpecBlockDrafter,
    target: torch.nn.Module,
    seqs: torch.Tensor,  # [n, T] held-out prompts followed by the target's greedy continuation
    first_start: int,  # prompt_len - 1
    num_blocks: int = 2,  # M
    batch_size: int = 8,
) -> dict:
    """α_k, τ and the rank head's bucket accuracy of ``drafter`` on ``seqs`` (fp32)."""
    k = drafter.config.block_size
    depth = k * num_blocks
    t = seqs.shape[1]
    starts = torch.arange(first_start, t - depth, device=drafter.d2t.device)  # [C]
    if starts.numel() == 0:
        raise ValueError(f"sequences of {t} tokens leave no chain of depth {depth}")
    was_training = drafter.training
    drafter.eval()
    t2d = target_to_draft_map(drafter.d2t, drafter.config.target_vocab_size)
    correct, predicted, actual, in_vocab = [], [], [], []
    device = drafter.d2t.device
    for chunk in seqs.split(batch_size):
        chunk = chunk.to(device)
        features = aux_hidden_states(target, chunk, drafter.config.aux_layer_ids)
        cuts = torch.full((chunk.shape[0], starts.numel(), num_blocks - 1), k, device=device)
        out = chain_forward(drafter, features, chunk, starts, cuts, draft_tokens=True)
        logits = torch.cat(out.logits, dim=2).float()  # [b, C, depth, V_d]
        labels = torch.cat(out.labels, dim=2)  # [b, C, depth]
        draft_labels = to_draft_ids(labels, t2d)
        ok = logits.argmax(-1) == draft_labels
        correct.append(ok)
        in_vocab.append(draft_labels >= 0)
        if out.rank_logits[0] is not None:
            valid = torch.cat([torch.ones_like(ok[..., :1]), ok[..., :-1]], -1).cumprod(-1)
            valid = valid.bool()
            scores = torch.cat(out.rank_logits, dim=2)  # [b, C, depth, 4]
            predicted.append(scores.argmax(-1)[valid])
            actual.append(bucket_labels(logits, draft_labels)[valid])
    if was_training:
        drafter.train()
    matches = torch.cat(correct).cpu()  # [n, C, depth]
    tokens, calls = replay_tau(matches)
    result = chain_rates(matches.flatten(0, 1))
    result.update(
        tau=round(tokens / calls, 4),
        num_verify_calls=calls,
        label_coverage=round(float(torch.cat(in_vocab).float().mean()), 4),
        num_sequences=int(seqs.shape[0]),
        num_chains=int(matches.shape[0] * matches.shape[1]),
        seq_len=t,
        first_start=first_start,
        block_size=k,
        num_blocks=num_blocks,
        rank_head=bucket_report(torch.cat(predicted), torch.cat(actual)) if predicted else None,
    )
    return result
