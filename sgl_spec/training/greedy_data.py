"""Training and evaluation data of the drafters (MTP adapter, SpecBlock drafter): the target's own
greedy continuations.

Speculative decoding accepts a draft exactly when it equals the target's own (greedy) choice, so
the masks are trained on what the *target* writes, not on the corpus: prompts are windows of the
corpus (train split for training, held-out split for evaluation) and the sequences are the
target's fp32 greedy continuations of them. Along such a sequence ``x``, the target's greedy
continuation after any prefix ``x[0..p]`` is ``x[p+1..]`` itself, so the label of mask ``j`` of
anchor ``p`` is simply ``x[p+j+1]``.

``greedy_continuation`` is also what the shipped draft's held-out agreement is measured along
(``sgl_spec.models.build.evaluate``).

Generation is the expensive part on a CPU, so it is cached under ``~/.cache/sgl_spec/mtp/`` in
chunks keyed by the target's weights, the corpus file and every generation parameter; an
interrupted run picks up at the first missing chunk.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sgl_spec.models.build.corpus import load_split
from sgl_spec.models.build.data import eval_windows

DEFAULT_CACHE = Path.home() / ".cache" / "sgl_spec" / "mtp"


@dataclass(frozen=True)
class GreedySpec:
    """Which prompts and how long a continuation: the identity of one cached data set."""

    split: str  # "train" or "eval"
    num_prompts: int
    prompt_len: int = 64
    num_new: int = 96
    seed: int = 0  # picks the train windows; eval windows are evenly spread, seed unused

    def __post_init__(self) -> None:
        if self.split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {self.split!r}")
        if min(self.num_prompts, self.prompt_len, self.num_new) <= 0:
            raise ValueError(f"num_prompts, prompt_len and num_new must be positive: {self}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.num_new


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_sha256(model_dir: Path) -> str:
    """One hash over the model directory's ``*.safetensors`` and ``config.json``."""
    h = hashlib.sha256()
    for p in sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]:
        h.update(f"{p.name}:{file_sha256(p)}\n".encode())
    return h.hexdigest()


def split_stream(tokenizer, corpus_dir: Path, split: str) -> torch.Tensor:  # [num_tokens]
    """``[eos] + tokens`` of every document of the split, concatenated (int64)."""
    texts = load_split(corpus_dir, split)
    eos = tokenizer.eos_token_id
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor([t for ids in encoded for t in [eos, *ids]], dtype=torch.long)


def prompt_windows(
    stream: torch.Tensor,  # [num_tokens]
    spec: GreedySpec,
) -> torch.Tensor:  # [num_prompts, prompt_len]
    """Train: random windows drawn with ``spec.seed``; eval: evenly spread windows."""
    if spec.split == "eval":
        windows = eval_windows(stream, spec.prompt_len, spec.num_prompts)
        return windows[:, : spec.prompt_len]
    if stream.numel() <= spec.prompt_len:
        raise ValueError(f"corpus split has {stream.numel()} tokens, fewer than one prompt")
    gen = torch.Generator().manual_seed(spec.seed)
    starts = torch.randint(0, stream.numel() - spec.prompt_len, (spec.num_prompts,), generator=gen)
    return torch.stack([stream[s : s + spec.prompt_len] for s in starts.tolist()])


@torch.no_grad()
def greedy_continuation(
    model: torch.nn.Module,
    prompts: torch.Tensor,  # [n, prompt_len]
    num_new: int,
) -> torch.Tensor:
    """The model's greedy continuation with a KV cache, never stopping early: ``[n, num_new]``."""
    out = model(input_ids=prompts, use_cache=True)
    cache, tokens = out.past_key_values, []
    next_tok = out.logits[:, -1].argmax(-1, keepdim=True)  # [n, 1]
    for _ in range(num_new):
        tokens.append(next_tok)
        out = model(input_ids=next_tok, past_key_values=cache, use_cache=True)
        cache, next_tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(tokens, dim=1)


def greedy_extend(
    model: torch.nn.Module,
    prompts: torch.Tensor,  # [n, prompt_len]
    num_new: int,
) -> torch.Tensor:  # [n, prompt_len + num_new]
    """Prompts followed by the model's greedy continuation (KV cache, never stopping early)."""
    return torch.cat([prompts, greedy_continuation(model, prompts, num_new)], dim=1)


def cache_key(spec: GreedySpec, target_sha: str, corpus_sha: str, chunk: int) -> str:
    """Batch size is part of the key: a batched matmul may round differently per batch size."""
    doc = {"spec": asdict(spec), "target": target_sha, "corpus": corpus_sha, "chunk": chunk}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def greedy_dataset(
    model: torch.nn.Module,
    tokenizer,
    target_dir: Path,
    corpus_dir: Path,
    spec: GreedySpec,
    cache_dir: Path = DEFAULT_CACHE,
    chunk: int = 64,
    progress: bool = True,
) -> tuple[torch.Tensor, float]:  # [num_prompts, prompt_len + num_new], generation seconds
    """The cached greedy sequences of ``spec``; missing chunks are generated (fp32) and saved.

    Also returns the wall time their generation took (summed over chunks, whenever they were
    made), so a model card can state the cost of a cached data set.
    """
    corpus_file = corpus_dir / f"{spec.split}.jsonl"
    if not corpus_file.is_file():
        raise FileNotFoundError(
            f"corpus split {corpus_file} not found; build it with "
            "`python -m sgl_spec.models.train corpus`"
        )
    key = cache_key(spec, weights_sha256(target_dir), file_sha256(corpus_file), chunk)
    out_dir = cache_dir / f"greedy-{spec.split}-{key}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec.json").write_text(json.dumps({**asdict(spec), "target": str(target_dir)}))
    starts = list(range(0, spec.num_prompts, chunk))
    missing = [s for s in starts if not (out_dir / f"chunk_{s:06d}.pt").is_file()]
    if missing:
        prompts = prompt_windows(split_stream(tokenizer, corpus_dir, spec.split), spec)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=spec.num_prompts, desc=f"greedy {spec.split}", mininterval=5.0)
            bar.update(spec.num_prompts - sum(min(chunk, spec.num_prompts - s) for s in missing))
        for s in missing:
            t0 = time.time()
            seqs = greedy_extend(model, prompts[s : s + chunk], spec.num_new)
            tmp = out_dir / f"chunk_{s:06d}.tmp"
            torch.save({"seqs": seqs, "wall_s": time.time() - t0}, tmp)
            tmp.replace(out_dir / f"chunk_{s:06d}.pt")
            if bar is not None:
                bar.update(seqs.shape[0])
        if bar is not None:
            bar.close()
    chunks = [torch.load(out_dir / f"chunk_{s:06d}.pt") for s in starts]
    return torch.cat([c["seqs"] for c in chunks]), sum(c["wall_s"] for c in chunks)
