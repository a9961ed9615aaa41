"""Token streams and batches for training and evaluation.

Every document becomes ``<|endoftext|> + tokens`` and the documents of a split are concatenated
into one stream, so training windows cross document boundaries the way packed pretraining does.
Batches are drawn from a generator seeded by ``(seed, step)``: a run resumed at step ``s`` sees
exactly the batches an uninterrupted run would, which is what makes ``--resume`` bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


def encode_stream(tokenizer, texts: Sequence[str]) -> np.ndarray:
    """Concatenate ``[eos] + encode(text)`` for every text, as a uint16/int32 array."""
    eos = tokenizer.eos_token_id
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    total = sum(len(ids) + 1 for ids in encoded)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.int32
    out = np.empty(total, dtype=dtype)
    pos = 0
    for ids in encoded:
        out[pos] = eos
        out[pos + 1 : pos + 1 + len(ids)] = ids
        pos += len(ids) + 1
    return out


def cached_stream(tokenizer, texts: Sequence[str], cache_file: Path) -> torch.Tensor:
    """Encode once and cache as ``.npy``; returns an int64 tensor of the whole stream."""
    if cache_file.is_file():
        arr = np.load(cache_file)
    else:
        arr = encode_stream(tokenizer, texts)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        np.save(cache_file, arr)
    return torch.from_numpy(arr.astype(np.int64))


def batch_generator(seed: int, step: int) -> torch.Generator:
    """The generator for one optimizer step; a pure function of ``(seed, step)``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def sample_batch(
    stream: torch.Tensor,  # [num_tokens]
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len + 1`` tokens; returns ``(inputs, labels)``, each ``[bs, seq_len]``."""
    if stream.numel() <= seq_len + 1:
        raise ValueError(f"token stream of {stream.numel()} tokens is shorter than seq_len+1")
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def eval_windows(
    stream: torch.Tensor,  # [num_tokens]
    seq_len: int,
    max_windows: int,
) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens, evenly spread: ``[n, seq_len + 1]``."""
    num = (stream.numel() - 1) // seq_len
    if num == 0:
        raise ValueError("eval stream shorter than one window")
    idx = torch.linspace(0, num - 1, steps=min(num, max_windows)).round().long().unique()
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in idx.tolist()])
