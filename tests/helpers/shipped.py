"""Requests whose greedy replies on the shipped target (non-speculative) several test modules
compare with: one ``none`` server computes them all once per session (``shipped_greedy`` in
``tests/conftest.py``) instead of one per module."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

# Code prompts: MTP_LORA's lossless tests and the two-rank tests of every algorithm.
SHIPPED_PROMPTS = [
    "def read_lines(path):\n    with open(path) as f:\n        return ",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self, text):\n        self.",
    "for i in range(len(items)):\n    ",
    "    if not isinstance(value, str):\n        raise TypeError(",
    "def __repr__(self):\n    return ",
]
SHIPPED_MAX_NEW_TOKENS = 48
# The fault tests' load: 64 excerpts of the standard library, as token ids.
NUM_STDLIB_PROMPTS = 64
STDLIB_MAX_NEW_TOKENS = 32


def shipped_greedy_request() -> dict:
    """The greedy ``/generate`` body of ``SHIPPED_PROMPTS`` (one batched request)."""
    greedy = {"temperature": 0, "max_new_tokens": SHIPPED_MAX_NEW_TOKENS}
    return {"text": SHIPPED_PROMPTS, "sampling_params": greedy}


@functools.cache
def stdlib_prompt_ids() -> list[list[int]]:
    """64 code excerpts of ``argparse.py``, 200 characters each, as the shipped target's ids
    (tokenized once per process; callers only read them)."""
    from transformers import AutoTokenizer

    from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path

    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    stride = len(source) // NUM_STDLIB_PROMPTS
    texts = [source[i * stride : i * stride + 200] for i in range(NUM_STDLIB_PROMPTS)]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_TARGET))
    return [tokenizer(text)["input_ids"] for text in texts]


def shipped_greedy_replies(server) -> dict[str, list[list[int]]]:
    """Every request set above, each sent as one batched greedy request to ``server``."""
    prompts = server.generate(shipped_greedy_request())
    stdlib = server.generate(
        {
            "input_ids": stdlib_prompt_ids(),
            "sampling_params": {"temperature": 0, "max_new_tokens": STDLIB_MAX_NEW_TOKENS},
        }
    )
    return {
        "prompts": [o["output_ids"] for o in prompts],
        "stdlib": [o["output_ids"] for o in stdlib],
    }
