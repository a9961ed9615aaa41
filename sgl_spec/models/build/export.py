"""Write a trained model as a self-contained Hugging Face directory.

Each shipped directory carries its own tokenizer files so SGLang, transformers and the
standalone draft worker can each be pointed at one directory. Weights are stored in bf16 when the
fp32 files would not fit the package's 64 MB budget; ``config.json`` still says float32, the
dtype every CPU consumer computes in, so loading upcasts exactly (bf16 -> fp32 is lossless) and
the metrics in the model card are measured on exactly these stored values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def save_model_dir(
    model: torch.nn.Module,
    out_dir: Path,
    tokenizer_dir: Path,
    storage_dtype: torch.dtype,
    extra_eos_ids: list[int],
) -> None:
    """Save config, ``model.safetensors`` (tied weights once), generation config and tokenizer."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        tensors[name] = tensor.detach().to(storage_dtype).contiguous().clone()
    weights = out_dir / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # save_file creates 0600; package files must be world-readable
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out_dir))
    eos = model.config.eos_token_id
    gen = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=[eos, *[i for i in extra_eos_ids if i != eos]],
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
    )
    gen.save_pretrained(str(out_dir))
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.is_file():
            shutil.copyfile(src, out_dir / name)
    if not (out_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer.json missing in tokenizer dir {tokenizer_dir}")


def load_model_dir(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load a saved directory with transformers, in ``dtype`` (default fp32), in eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model dir {path}")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


def weights_megabytes(model_dir: Path) -> float:
    """Size of the weight files on disk, in MB (10^6 bytes)."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 1e6


def read_json(path: Path) -> dict:
    """Small helper so callers need not repeat the encoding dance."""
    return json.loads(path.read_text(encoding="utf-8"))
