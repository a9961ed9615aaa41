"""Tiny random-weight Llama models + a byte-level BPE tokenizer, a tiny corpus and a tiny
SpecBlock drafter, built on the fly for tests.

Random weights are fine for mechanics (greedy equality, sampling distribution); the lm_head is
scaled up so next-token distributions are peaked and greedy argmaxes are separated by clear
margins rather than float noise.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_spec.specblock.config import SpecBlockConfig
    from sgl_spec.specblock.model import SpecBlockDrafter

CORPUS_FILES = {"train": ("textwrap.py", "string.py"), "eval": ("bisect.py",)}
# the tiny SpecBlock drafter: block size, (target) hidden size, target vocab, draft vocab
SPECBLOCK_K, SPECBLOCK_D, SPECBLOCK_V, SPECBLOCK_VD = 3, 32, 64, 24

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / name) for names in CORPUS_FILES.values() for name in names]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(files, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 2048,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def build_llama(
    out_dir: Path,
    *,
    seed: int,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    logit_scale: float = 40.0,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a random LlamaForCausalLM (fp32 safetensors) + tokenizer to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    _save(model, out_dir, tokenizer_dir)
    return out_dir


def perturbed_copy(src_dir: Path, out_dir: Path, *, seed: int, noise: float) -> Path:
    """A draft that agrees with the target most of the time: its weights plus Gaussian noise
    (relative scale ``noise``), so acceptance is high but rejections really happen."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * param.std() * noise)
    _save(model, out_dir, src_dir)
    return out_dir


def constant_draft(src_dir: Path, out_dir: Path) -> Path:
    """A draft whose greedy drafts are always token 0 (final norm zeroed: all logits equal),
    so every algorithm drafting with it advances each request by the same tokens per step."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    _save(model, out_dir, src_dir)
    return out_dir


def _save(model, out_dir: Path, tokenizer_dir: Path | None) -> None:
    import shutil

    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir is None:
        build_tokenizer(out_dir, model.config.vocab_size)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, out_dir / name)


def build_corpus(root: Path) -> Path:
    """A corpus directory (``train.jsonl`` / ``eval.jsonl``, the layout ``sgl_spec.models.build.corpus``
    writes) of a few stdlib modules, for the training CLIs."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root.mkdir(parents=True, exist_ok=True)
    for split, names in CORPUS_FILES.items():
        with open(root / f"{split}.jsonl", "w") as f:
            for name in names:
                f.write(json.dumps({"path": name, "text": (stdlib / name).read_text()}) + "\n")
    return root


def specblock_config(**overrides: object) -> SpecBlockConfig:
    """A SpecBlock config for a 4-layer target of hidden size ``SPECBLOCK_D``; ``overrides``
    replace ``SpecBlockConfig.from_target`` arguments."""
    from transformers import LlamaConfig

    from sgl_spec.specblock.config import SpecBlockConfig

    target = LlamaConfig(
        hidden_size=SPECBLOCK_D,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=SPECBLOCK_V,
    )
    kwargs = dict(draft_vocab_size=SPECBLOCK_VD, block_size=SPECBLOCK_K, rank_hidden_size=16)
    kwargs.update(overrides)
    return SpecBlockConfig.from_target(target, **kwargs)


def specblock_drafter(seed: int = 0, **overrides: object) -> SpecBlockDrafter:
    """A seeded random drafter of ``specblock_config(**overrides)`` in eval mode, with a random
    draft vocabulary of ``SPECBLOCK_VD`` target ids."""
    import torch

    from sgl_spec.specblock.model import SpecBlockDrafter

    torch.manual_seed(seed)
    model = SpecBlockDrafter(specblock_config(**overrides)).eval()
    model.set_draft_vocab(torch.randperm(SPECBLOCK_V)[:SPECBLOCK_VD])
    return model


def train_specblock_drafter(
    target_dir: Path,
    out_dir: Path,
    *,
    seed: int = 0,
    steps: int = 200,
    block_size: int = 3,
    aux_layer_ids: tuple[int, int, int] = (0, 0, 0),
) -> Path:
    """Train a small SpecBlock drafter for ``target_dir`` on the target's own greedy
    continuations of stdlib-code prompts (the paper's §4.1 recipe, few steps) and save it.

    ``aux_layer_ids`` default to layer 0 three times: on a 2-layer target that is the only
    layer output SGLang can capture (it captures layer inputs, never the last layer's output).
    """
    import torch
    from transformers import AutoTokenizer

    from sgl_spec.models.build.evaluate import greedy_continuation
    from sgl_spec.models.build.export import load_model_dir
    from sgl_spec.specblock.training.data import draft_vocab
    from sgl_spec.specblock.training.trainer import (
        SpecBlockTrainConfig,
        build_drafter,
        train_drafter,
    )
    from sgl_spec.training.loop import RunOptions

    prompt_len, new_tokens, num_seqs = 16, 48, 48
    target = load_model_dir(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in CORPUS_FILES["train"])
    ids = torch.tensor(tokenizer(text)["input_ids"])
    stride = (ids.numel() - prompt_len) // num_seqs
    prompts = torch.stack([ids[i * stride : i * stride + prompt_len] for i in range(num_seqs)])
    with torch.no_grad():
        seqs = torch.cat([prompts, greedy_continuation(target, prompts, new_tokens)], dim=1)
    d2t, _ = draft_vocab(seqs, prompt_len, target.config.vocab_size, 256)
    drafter = build_drafter(
        target,
        d2t,
        seed=seed,
        block_size=block_size,
        num_layers=1,
        rank_hidden_size=32,
        aux_layer_ids=aux_layer_ids,
    )
    cfg = SpecBlockTrainConfig(
        steps=steps,
        batch_size=8,
        first_start=prompt_len - 1,
        lr=3e-3,
        warmup_steps=10,
        rank_warmup_steps=steps // 3,
        seed=seed,
        bf16_autocast=False,
    )
    train_drafter(drafter, target, seqs, cfg, RunOptions(progress=False))
    drafter.save_pretrained(out_dir)
    return out_dir


def swapped_tokenizer_copy(src_dir: Path, out_dir: Path) -> Path:
    """A copy of the model ``src_dir`` whose tokenizer maps two tokens to each other's ids:
    the same vocabulary size, another tokenizer."""
    import shutil

    shutil.copytree(src_dir, out_dir)
    tokenizer = json.loads((out_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = (token for token, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out_dir


def random_mtp_adapter(target_dir: Path, out_dir: Path, **dims: int) -> Path:
    """An untrained MTP adapter for the target ``target_dir`` (its shapes; ``dims`` overrides
    ``BaseDims`` fields, e.g. ``num_layers=4`` for an adapter of another target)."""
    import dataclasses

    from transformers import AutoConfig

    from sgl_spec.mtp.adapter_io import save_adapter
    from sgl_spec.mtp.config import BaseDims, MtpAdapterConfig
    from sgl_spec.mtp.gated_lora import MtpAdapter

    base = dataclasses.replace(
        BaseDims.from_hf_config(AutoConfig.from_pretrained(target_dir)), **dims
    )
    config = MtpAdapterConfig(rank=4, alpha=8.0, k_max=2, mask_token_ids=(3, 4))
    return save_adapter(out_dir, MtpAdapter(config, base), config)


def random_specblock_drafter(target_dir: Path, out_dir: Path, num_target_layers: int = 0) -> Path:
    """An untrained SpecBlock drafter for the target ``target_dir``, or, with
    ``num_target_layers``, for a deeper target of the same width (its aux layers out of reach)."""
    import torch
    from transformers import AutoConfig

    from sgl_spec.specblock.config import SpecBlockConfig
    from sgl_spec.specblock.model import SpecBlockDrafter

    target = AutoConfig.from_pretrained(target_dir)
    layers = num_target_layers or target.num_hidden_layers
    target.num_hidden_layers = layers
    aux = (0, 0, 0) if layers <= 2 else (0, layers // 2, layers - 1)
    config = SpecBlockConfig.from_target(
        target,
        draft_vocab_size=32,
        block_size=2,
        rank_hidden_size=8,
        num_layers=1,
        aux_layer_ids=aux,
    )
    torch.manual_seed(0)
    SpecBlockDrafter(config).save_pretrained(out_dir)
    return out_dir
