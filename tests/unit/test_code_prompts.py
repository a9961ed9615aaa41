"""benchmarks/code_prompts.py (``bench_speculative.py --prompts code``): windows of held-out
source, the bench_serving dataset they become, and the same prompts on every path."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import _bench_lib as lib
import bench_speculative as bench
import code_prompts
import hf_peer
import numpy as np
import pytest
from transformers import AutoTokenizer

from sgl_spec.models.build.corpus import read_corpus
from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path

NUM, LENGTH = 5, 64


@pytest.fixture(scope="module")
def target() -> str:
    return resolve_model_path(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def windows(target: str) -> tuple[list[str], list[list[int]]]:
    return code_prompts.code_windows(target, NUM, LENGTH)


def test_windows_are_held_out_code_of_the_asked_length(target: str, windows) -> None:
    texts, ids = windows
    assert len(texts) == len(ids) == NUM
    tokenizer = AutoTokenizer.from_pretrained(target)
    entries, sources = read_corpus()
    held_out = [sources[e.path] for e in entries if e.split == "eval"]
    trained = [sources[e.path] for e in entries if e.split == "train"]
    for text, window in zip(texts, ids, strict=True):
        assert len(window) == LENGTH
        assert tokenizer.decode(window) == text
        assert any(text in source for source in held_out)
        assert not any(text in source for source in trained)
    assert len(set(texts)) == NUM
    # deterministic: a second call gives the same windows
    assert code_prompts.code_windows(target, NUM, LENGTH) == windows


def test_too_long_a_window_is_a_clear_error(target: str) -> None:
    with pytest.raises(ValueError, match="smaller --input-len"):
        code_prompts.code_windows(target, 1, 10**7)


def test_bench_serving_loads_every_prompt_as_the_peer_does(tmp_path: Path, target, windows) -> None:
    """The file goes through bench_serving's own ``custom`` loader, seeded as the peer seeds it:
    every prompt, each with the fixed output length."""
    from sglang.benchmark.datasets.custom import sample_custom_requests

    texts, _ = windows
    path = code_prompts.write_dataset(tmp_path / "d.jsonl", texts)
    tokenizer = AutoTokenizer.from_pretrained(target)
    random.seed(1)
    np.random.seed(1)
    rows = sample_custom_requests(str(path), NUM, tokenizer, fixed_output_len=16)
    assert sorted(r.prompt for r in rows) == sorted(texts)
    assert {r.output_len for r in rows} == {16}
    assert all(json.loads(line)["conversations"][0]["role"] == "user" for line in open(path))


def test_prompts_code_reaches_bench_serving_greedy_check_and_peer(tmp_path: Path, windows) -> None:
    argv = ["--algorithms", "none", "--prompts", "code", "--num-prompts", str(NUM)]
    args, extra = lib.parse_args([*argv, "--input-len", str(LENGTH), "--output-len", "8"])
    assert args.prompts == "code"
    bench.prepare_prompts(args, extra, tmp_path)
    assert args.code_windows == windows[1]
    command = lib.bench_serving_argv(1, args, "/m", tmp_path / "o.jsonl")
    assert command.count("--dataset-name") == 1
    assert lib.flag_value(command, "--dataset-name") == "custom"
    assert lib.flag_value(command, "--dataset-path") == str(tmp_path / code_prompts.DATASET_FILE)
    assert lib.flag_value(command, "--sharegpt-output-len") == "8"
    greedy = bench.greedy_prompts(args)
    assert len(greedy) == bench.NUM_GREEDY_PROMPTS
    assert greedy[0] == windows[1][0][: bench.MAX_GREEDY_PROMPT_LEN]
    spec = hf_peer.peer_spec("hf", args, extra, greedy, 8)
    assert spec["dataset_path"] == str(args.dataset_path)


def test_each_round_gets_code_it_has_not_met(tmp_path: Path, target: str, windows) -> None:
    """Rounds of ``--prompts code`` read windows of their own: round 0's are the single-round
    windows, and no window with the output after it overlaps another's in its file."""
    follow = 32
    # enough rounds that windows drawn at random would overlap in the smaller files
    rounds = code_prompts.code_window_rounds(target, NUM, LENGTH, follow, 24)
    assert rounds[0] == windows
    tokenizer = AutoTokenizer.from_pretrained(target)
    entries, sources = read_corpus()
    held_out = [sources[e.path] for e in entries if e.split == "eval"]
    spans: dict[int, list[tuple[int, int]]] = {}
    for texts, _ in rounds:
        for text in texts:
            f = next(i for i, source in enumerate(held_out) if text in source)
            start = held_out[f].index(text)
            ids = tokenizer.encode(held_out[f][start : start + 4000], add_special_tokens=False)
            spans.setdefault(f, []).append(
                (start, start + len(tokenizer.decode(ids[: LENGTH + follow])))
            )
    for taken in spans.values():
        for (a0, a1), (b0, b1) in itertools.combinations(taken, 2):
            assert a1 <= b0 or b1 <= a0, (a0, a1, b0, b1)
    argv = ["--algorithms", "none", "--prompts", "code", "--num-prompts", str(NUM), "--rounds", "3"]
    args, extra = lib.parse_args([*argv, "--input-len", str(LENGTH), "--output-len", str(follow)])
    bench.prepare_prompts(args, extra, tmp_path)
    assert len(args.dataset_paths) == 3 and args.code_windows == windows[1]
    for r in range(3):
        command = lib.bench_serving_argv(1, bench.at_round(args, r), None, tmp_path / "o.jsonl")
        assert lib.flag_value(command, "--dataset-path") == str(args.dataset_paths[r])
        lines = [json.loads(line) for line in open(args.dataset_paths[r])]
        assert [line["conversations"][0]["content"] for line in lines] == rounds[r][0]
    repeat, extra = lib.parse_args([*argv, "--repeat-prompts", "--input-len", str(LENGTH)])
    (tmp_path / "r").mkdir()
    bench.prepare_prompts(repeat, extra, tmp_path / "r")
    assert len(repeat.dataset_paths) == 1
    assert bench.at_round(repeat, 2).dataset_path == repeat.dataset_paths[0]


def test_default_prompts_stay_random_ids() -> None:
    args, extra = lib.parse_args(["--algorithms", "none"])
    bench.prepare_prompts(args, extra, Path("/nonexistent"))
    assert lib.flag_value(lib.bench_serving_argv(1, args, None, Path("o")), "--dataset-name") == (
        "random-ids"
    )
    assert hf_peer.peer_spec("hf", args, extra, [], 8)["dataset_path"] is None
    with pytest.raises(SystemExit):
        lib.parse_args(["--algorithms", "none", "--prompts", "sharegpt"])
