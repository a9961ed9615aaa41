"""Prompts of real code for ``bench_speculative.py --prompts code``.

The harness's default load is bench_serving's ``random-ids``: prompts of random tokens, whose
greedy continuations by the shipped target fall into repetition, which model-free drafters
(SGLang's NGRAM) predict unusually well. ``--prompts code`` drives every server and peer with
windows of held-out Python source instead: files of the corpus's ``eval`` split
(``sgl_spec/models/build/corpus.py``: the running interpreter's standard library, split by a
hash of each path), which neither the shipped target nor any shipped drafter saw in training.

Each prompt starts at a line start drawn with a fixed seed from one eval file (the files taken
in turn, largest first) and holds ``input_len`` tokens of the target's tokenizer. The prompts
go to bench_serving as its ``custom`` dataset (a JSONL of one user turn each; bench_serving
shuffles them with its seed and sends each with ``--sharegpt-output-len`` new tokens and
``ignore_eos``, as it does for ``random-ids``), so the server tokenizes the text as any client's;
the greedy check and the transformers peers get the same prompts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT_SETS = ("random-ids", "code")
DATASET_FILE = "code_prompts.jsonl"
SEED = 0
# A file shorter than this many tokens beyond the window gives windows too alike to its start.
MIN_FILE_TOKENS = 256


def code_windows(
    tokenizer_dir: str, num_prompts: int, input_len: int
) -> tuple[list[str], list[list[int]]]:
    """``num_prompts`` windows of held-out standard-library source, each ``input_len`` tokens
    of the tokenizer at ``tokenizer_dir``: their text and their token ids, deterministic per
    host interpreter version."""
    from transformers import AutoTokenizer

    from sgl_spec.models.build.corpus import read_corpus

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    entries, texts = read_corpus()
    held_out = sorted(
        (texts[e.path] for e in entries if e.split == "eval"), key=lambda t: (-len(t), t)
    )
    files = []  # (text, ids) of the largest files long enough, as many as prompts
    for text in held_out[: max(num_prompts, 1) * 2]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= input_len + MIN_FILE_TOKENS:
            files.append((text, ids))
        if len(files) == num_prompts:
            break
    if not files:
        raise ValueError(
            f"no held-out source file has {input_len} + {MIN_FILE_TOKENS} tokens; "
            "use a smaller --input-len"
        )
    rng = random.Random(SEED)
    prompts, windows = [], []
    for i in range(num_prompts):
        text, ids = files[i % len(files)]
        # a line start early enough for a full window after it
        last = len(tokenizer.decode(ids[: len(ids) - input_len]))
        starts = [0] + [j + 1 for j in range(last) if text[j] == "\n"]
        start = rng.choice(starts)
        window = tokenizer.encode(text[start:], add_special_tokens=False)[:input_len]
        prompts.append(tokenizer.decode(window))
        windows.append(window)
    return prompts, windows


def write_dataset(path: Path, prompts: list[str]) -> Path:
    """bench_serving's ``custom`` JSONL: one conversation per prompt (its completion unused:
    the output length is fixed)."""
    with open(path, "w", encoding="utf-8") as f:
        for text in prompts:
            turns = [{"role": "user", "content": text}, {"role": "assistant", "content": "."}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


def bench_serving_dataset(path: Path, output_len: int) -> list[str]:
    """bench_serving flags for the file ``write_dataset`` wrote."""
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(path),
        "--sharegpt-output-len",
        str(output_len),
    ]
