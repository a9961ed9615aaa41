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
the greedy check and the transformers peers get the same prompts. Each round of a benchmark
gets windows of its own (``code_window_rounds``): no window or the source after it is met
twice, so a server that keeps what it served (SGLang's NGRAM corpus) cannot replay a
continuation it generated in an earlier round.
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
# random draws of a start before trying every start in turn
MAX_DRAWS = 64


def code_windows(
    tokenizer_dir: str, num_prompts: int, input_len: int
) -> tuple[list[str], list[list[int]]]:
    """``num_prompts`` windows of held-out standard-library source, each ``input_len`` tokens
    of the tokenizer at ``tokenizer_dir``: their text and their token ids, deterministic per
    host interpreter version."""
    return code_window_rounds(tokenizer_dir, num_prompts, input_len, 0, 1)[0]


def code_window_rounds(
    tokenizer_dir: str, num_prompts: int, input_len: int, output_len: int, rounds: int
) -> list[tuple[list[str], list[list[int]]]]:
    """``code_windows`` for each of ``rounds`` passes: round 0's are ``code_windows``' own, and
    no window, with the ``output_len`` tokens that follow it in its file, overlaps another's
    (source a server read or generated in one round is never a prompt or a continuation it
    meets again)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    files = _long_files(tokenizer, num_prompts, input_len)
    # per file, the line starts early enough for a full window after them (found once)
    line_starts = []
    for text, ids in files:
        last = len(tokenizer.decode(ids[: len(ids) - input_len]))
        line_starts.append([0] + [j + 1 for j in range(last) if text[j] == "\n"])
    rng = random.Random(SEED)
    taken: list[list[tuple[int, int]]] = [[] for _ in files]  # per file: char spans used
    out = []
    for _ in range(rounds):
        prompts, windows = [], []
        for i in range(num_prompts):
            f = i % len(files)
            start, tokens = _free_window(
                tokenizer, files[f][0], line_starts[f], taken[f], rng, input_len + output_len
            )
            window = tokens[:input_len]
            prompts.append(tokenizer.decode(window))
            windows.append(window)
        out.append((prompts, windows))
    return out


def _long_files(tokenizer, num_prompts: int, input_len: int) -> list[tuple[str, list[int]]]:
    """(text, ids) of the largest held-out files long enough, as many as prompts (or fewer)."""
    from sgl_spec.models.build.corpus import read_corpus

    entries, texts = read_corpus()
    held_out = sorted(
        (texts[e.path] for e in entries if e.split == "eval"), key=lambda t: (-len(t), t)
    )
    files = []
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
    return files


def _free_window(
    tokenizer, text: str, starts: list[int], taken: list[tuple[int, int]], rng, span: int
) -> tuple[int, list[int]]:
    """A start drawn from ``starts`` whose next ``span`` tokens overlap no span in ``taken``
    (which gets this one), and those tokens. The first draw is kept when nothing is taken,
    so a file's first window is the one a single round draws."""

    def order():  # drawn one at a time: a file's first window costs one draw, as it always did
        for _ in range(MAX_DRAWS):
            yield rng.choice(starts)
        yield from starts

    for start in order():
        tokens = tokenizer.encode(text[start : start + span * 32], add_special_tokens=False)
        if len(tokens) < span + 1:  # near the end of the file: tokenize all that is left
            tokens = tokenizer.encode(text[start:], add_special_tokens=False)
        tokens = tokens[:span]
        end = start + len(tokenizer.decode(tokens))
        if all(end <= first or start >= stop for first, stop in taken):
            taken.append((start, end))
            return start, tokens
    raise ValueError(
        f"a held-out file has no room for another {span}-token window; "
        "use fewer --rounds or --num-prompts, or a smaller --input-len / --output-len"
    )


def dataset_file(round_index: int) -> str:
    """The file name of one round's dataset (round 0's is ``DATASET_FILE``)."""
    return DATASET_FILE if round_index == 0 else f"code_prompts_round{round_index}.jsonl"


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
