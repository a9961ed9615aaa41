"""Byte-level BPE tokenizer for the embedded models, saved in Hugging Face format.

Byte-level BPE makes encode/decode of any source text an exact round trip (indentation and
unusual characters included), which the losslessness tests of the speculative algorithms rely on
when they compare decoded strings. The ChatML-style template lets ``/v1/chat/completions`` work
against the tiny models even though they were never trained on chat data. The reserved special
tokens are kept free now so later adapters (MTP mask tokens, DESIGN.md) need no vocabulary change.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
NUM_RESERVED = 16
RESERVED_TOKENS = [f"<|reserved_{i}|>" for i in range(NUM_RESERVED)]
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END, *RESERVED_TOKENS]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> None:
    """Train a byte-level BPE on ``texts`` and save it (HF format) into ``out_dir``.

    Training is deterministic for a given corpus: the trainer counts pairs exactly and breaks
    ties by a fixed order, so the same corpus gives the same ``tokenizer.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    save_hf_tokenizer(tok, out_dir)


def save_hf_tokenizer(tok, out_dir: Path) -> None:
    """Wrap a ``tokenizers.Tokenizer`` as ``PreTrainedTokenizerFast`` and save it with its template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END, *RESERVED_TOKENS],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    # transformers 5 writes the template to chat_template.jinja only; older loaders (and tools
    # that read the JSON directly) look for it in tokenizer_config.json, so it goes in both.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def load_tokenizer(path: str | Path):
    """Load a saved tokenizer with ``AutoTokenizer`` (the same path SGLang takes)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def special_token_ids(tokenizer) -> dict[str, int]:
    """Ids of the special tokens, checked to exist (a wrong tokenizer dir fails loudly here)."""
    ids = {}
    for t in SPECIAL_TOKENS:
        i = tokenizer.convert_tokens_to_ids(t)
        if i is None or i == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer is missing special token {t!r}")
        ids[t] = int(i)
    return ids
