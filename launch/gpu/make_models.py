"""Random-weight models for a GPU run that carries none of the shipped weights (docs/gpu.md).

    python launch/gpu/make_models.py OUT --preset 1b --device cuda

Writes, under OUT:
- ``target``: a random LlamaForCausalLM of the preset's shape, bf16 on CUDA (fp32 on CPU), with
  the shipped ``tiny-code`` tokenizer (its vocabulary sets the model's). The served draft for
  an *identical-draft* check is this same directory.
- ``draft``: the target's first ``--draft-layers`` decoder layers with its embedding, final norm
  and head: a draft of realistic cost (~ draft_layers / layers of the target). With random
  weights it seldom agrees with the target (mean accept 1.03 of 4 on the ``tiny`` preset):
  it exercises rejections, not drafting quality.
- ``mtp``: a freshly initialised gated-LoRA adapter for the target (``sgl_spec.mtp``), k_max 4.
- ``specblock``: a freshly initialised SpecBlock drafter for the target (K = 4, one layer).
- ``models.json``: the paths and shapes.

Random weights make acceptance a property of construction, not of learning: these models check
losslessness, the identical-draft acceptance and step costs; they say nothing about how well a
trained drafter drafts. The head of every logit row is scaled up (``--logit-scale``) so greedy
argmaxes are separated by clear margins rather than by bf16 noise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

PRESETS = {
    # hidden, layers, heads, kv heads, intermediate
    "tiny": (256, 4, 4, 2, 512),  # CPU dry runs of smoke.sh
    "1b": (2048, 16, 32, 8, 8192),  # Llama-3.2-1B-like body
    "8b": (4096, 32, 32, 8, 14336),  # Llama-3.1-8B-like body (~14 GB in bf16 at this vocabulary)
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def shipped_tokenizer_dir() -> Path:
    from sgl_spec.models.registry import resolve_model_path

    return Path(resolve_model_path("sgl-spec/tiny-code"))


def build(
    out: Path, preset: str, device: str, draft_layers: int, logit_scale: float, seed: int
) -> dict:
    """Write the four model directories under ``out``; return what ``models.json`` holds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgl_spec.mtp.adapter_io import save_adapter
    from sgl_spec.mtp.config import BaseDims, MtpAdapterConfig
    from sgl_spec.mtp.gated_lora import MtpAdapter
    from sgl_spec.specblock.training.trainer import build_drafter

    hidden, layers, heads, kv_heads, inter = PRESETS[preset]
    if not 1 <= draft_layers < layers:
        raise SystemExit(f"--draft-layers must be in [1, {layers - 1}] for preset {preset}")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tok_dir = shipped_tokenizer_dir()
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        rope_theta=10000.0,
    )
    target = _construct(LlamaForCausalLM, config, device, dtype)
    with torch.no_grad():
        target.lm_head.weight.mul_(logit_scale)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("target", "draft", "mtp", "specblock")}
    _save(target, paths["target"], tok_dir)

    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": draft_layers})
    draft = _construct(LlamaForCausalLM, draft_config, device, dtype)
    state = {k: v for k, v in target.state_dict().items() if _layer_index(k) < draft_layers}
    draft.load_state_dict(state, strict=True)
    _save(draft, paths["draft"], tok_dir)

    dims = BaseDims.from_hf_config(config)
    mtp_config = MtpAdapterConfig(
        rank=16,
        alpha=32.0,
        k_max=4,
        base_model=str(paths["target"]),
        mask_token_ids=tuple(range(vocab - 4, vocab)),
    )
    adapter = MtpAdapter(mtp_config, dims)
    generator = torch.Generator().manual_seed(seed)
    adapter.reset_parameters(target.get_input_embeddings().weight.float().cpu(), generator)
    save_adapter(paths["mtp"], adapter, mtp_config, {"random": True, "preset": preset})

    d2t = torch.arange(min(vocab, 2048))
    aux = (1, layers // 2, layers - 2)
    drafter = build_drafter(  # takes the target's config and embedding only
        target,
        d2t,
        seed=seed,
        block_size=4,
        num_layers=1,
        rank_hidden_size=64,
        aux_layer_ids=aux,
    )
    drafter.save_pretrained(paths["specblock"])
    info = {
        "preset": preset,
        "shape": dict(
            zip(
                ("hidden", "layers", "heads", "kv_heads", "intermediate"),
                PRESETS[preset],
                strict=True,
            )
        ),
        "vocab": vocab,
        "dtype": str(dtype).removeprefix("torch."),
        "draft_layers": draft_layers,
        "params_target": sum(p.numel() for p in target.parameters()),
        "params_draft": sum(p.numel() for p in draft.parameters()),
        **{name: str(path) for name, path in paths.items()},
    }
    (out / "models.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def _construct(cls, config, device: str, dtype):
    """A model built directly on ``device`` in ``dtype`` (an 8B target built in float32 first
    would need twice its memory)."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(default)


def _layer_index(key: str) -> int:
    """Decoder-layer index of a state-dict key; -1 for embedding, norm and head."""
    parts = key.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1


def _save(model, out_dir: Path, tok_dir: Path) -> None:
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out_dir / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--draft-layers", type=int, default=None, help="default: layers // 8")
    parser.add_argument("--logit-scale", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    draft_layers = args.draft_layers or max(1, PRESETS[args.preset][1] // 8)
    info = build(args.out, args.preset, device, draft_layers, args.logit_scale, args.seed)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
