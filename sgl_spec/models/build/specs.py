"""Architecture presets of the embedded target and draft models.

Sizing (measured on the 2-core dev CPU, see the model card): the target must be large enough
that its batch-16 decode forward is a real cost next to SGLang's ~13 ms per-step serving
overhead, yet train in about an hour on one core. Width 512 x 8 layers (~26M parameters) runs
~1000 tokens/s of bf16 training on an idle core (~1.4 epochs of the ~2.6M-token corpus per
hour); its batch-16 decode costs ~33 ms with 2 threads in plain transformers vs ~4 ms for a
1-layer model of the same width and vocabulary, so the model's own compute dominates the step.
The draft keeps the target's width so it can start from the target's embeddings, final norm and
first layer (distillation then only has to adapt, not learn from zero), and has a single layer,
so it costs ~5x less per token.

Embeddings are tied in both models: with a 4096-token vocabulary the output matrix is a small
part of the compute, tying loses little quality at this scale, and it keeps the shipped weights of
both models under the 64 MB budget.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-architecture causal LM; the vocabulary comes from the tokenizer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads")


TARGET_SPEC = ModelSpec(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1280)
DRAFT_SPEC = ModelSpec(hidden_size=512, num_layers=1, num_heads=8, intermediate_size=1280)
# Half the target's width (head dim 64 kept): its weights, output matrix included, are about a
# third of DRAFT_SPEC's, so a served decode reads a third of the bytes. It starts from the
# target's embeddings projected onto their 256 leading singular directions.
NARROW_DRAFT_SPEC = ModelSpec(hidden_size=256, num_layers=1, num_heads=4, intermediate_size=768)
# Only for the reproducibility test and quick smoke runs.
TINY_SPEC = ModelSpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
PRESETS = {
    "target": TARGET_SPEC,
    "draft": DRAFT_SPEC,
    "draft-narrow": NARROW_DRAFT_SPEC,
    "tiny": TINY_SPEC,
}


def build_config(spec: ModelSpec, vocab_size: int, eos_token_id: int):
    """A ``LlamaConfig`` for ``spec``; ``dtype`` float32 because tests and CPU serving run fp32."""
    from transformers import LlamaConfig

    # ModelSpec's fields that LlamaConfig names alike, and what every preset shares
    same = ("hidden_size", "intermediate_size", "max_position_embeddings", "rope_theta",
            "tie_word_embeddings")  # fmt: skip
    fixed = {"rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False,
             "mlp_bias": False, "dtype": "float32"}  # fmt: skip
    return LlamaConfig(
        vocab_size=vocab_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        **{name: getattr(spec, name) for name in same},
        **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"), eos_token_id),
        **fixed,
    )


def build_model(spec: ModelSpec, vocab_size: int, eos_token_id: int, seed: int):
    """A freshly initialised ``LlamaForCausalLM``; the init depends only on ``seed``."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(build_config(spec, vocab_size, eos_token_id))


def count_parameters(model) -> int:
    """Unique parameters (a tied embedding counted once)."""
    seen = {id(p): p.numel() for p in model.parameters()}
    return sum(seen.values())
