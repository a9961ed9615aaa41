"""The SpecBlock drafter's configuration and checkpoint format (paper §3.1, §4.1, Table 2).

``SpecBlockConfig`` holds the drafter's shape and ablation flags and the Llama per-layer
settings it copies from the target; ``to_dict``/``from_dict`` are its ``config.json``. The
checkpoint file names, format version and :class:`CheckpointError` live here too, so reading a
drafter's config needs no torch; the ``nn.Module`` that saves and loads the weights is
``model.py``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from transformers import LlamaConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_TYPE = "specblock_drafter"
FORMAT_VERSION = 1
# Llama per-layer settings carried over from the target (§4.1: layers match the target's).
_LAYER_KEYS = (
    "intermediate_size num_attention_heads num_key_value_heads head_dim hidden_act rms_norm_eps "
    "rope_parameters max_position_embeddings attention_bias mlp_bias"
).split()


class CheckpointError(ValueError):
    """A drafter checkpoint directory is missing a file or holds a corrupt/incompatible one."""


@dataclass
class SpecBlockConfig:
    """Shape and ablation flags of the drafter (§3.1, §4.1 defaults K=4, L=2, Table 2 flags).

    ``aux_layer_ids`` are the target layers whose *outputs* form (low, mid, top), EAGLE-3's
    ``eagle_aux_hidden_state_layer_ids`` convention. ``layer_config`` holds the Llama per-layer
    settings (heads, MLP width, rope, eps) of the drafter's decoder layers.
    """

    hidden_size: int  # d
    target_hidden_size: int  # d_target
    target_vocab_size: int
    draft_vocab_size: int  # V_d
    aux_layer_ids: tuple[int, int, int]
    block_size: int = 4  # K
    num_layers: int = 2  # L
    rank_hidden_size: int = 256
    prefix_broadcast: bool = True
    layer_shift: bool = True
    rank_head: bool = True
    layer_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)  # type: ignore[assignment]
        positive = ("hidden_size", "target_hidden_size", "target_vocab_size", "block_size")
        for name in (*positive, "num_layers", "rank_hidden_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SpecBlockConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 10 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"SpecBlockConfig.draft_vocab_size must be in [10, target_vocab_size="
                f"{self.target_vocab_size}] (psi needs the top 10), got {self.draft_vocab_size}"
            )
        if len(self.aux_layer_ids) != 3 or min(self.aux_layer_ids) < 0:
            raise ValueError(
                f"SpecBlockConfig.aux_layer_ids must be 3 layer ids >= 0, got {self.aux_layer_ids}"
            )

    @classmethod
    def from_target(
        cls,
        target: LlamaConfig,
        *,
        draft_vocab_size: int,
        layer_overrides: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> SpecBlockConfig:
        """Drafter config for ``target``: by default the target's hidden size and per-layer
        architecture (App. A.1); ``overrides`` replace config fields (``hidden_size`` for a
        narrower drafter) and ``layer_overrides`` per-layer keys (``intermediate_size``, heads)."""
        n = target.num_hidden_layers
        # SGLang's EAGLE-3 default captures the inputs of layers (2, n//2, n-3); tiny targets
        # spread the three over the stack instead.
        default_ids = (1, n // 2 - 1, n - 4) if n >= 8 else (0, (n - 1) // 2, n - 1)
        layer = {k: getattr(target, k) for k in _LAYER_KEYS if getattr(target, k, None) is not None}
        layer_overrides = layer_overrides or {}
        unknown = sorted(set(layer_overrides) - set(_LAYER_KEYS))
        if unknown:
            raise ValueError(f"unknown per-layer keys {unknown}")
        layer.update(layer_overrides)
        kwargs: dict[str, Any] = dict(
            hidden_size=target.hidden_size,
            target_hidden_size=target.hidden_size,
            target_vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=default_ids,
            layer_config=json.loads(json.dumps(layer)),
        )
        kwargs.update(overrides)
        config = cls(**kwargs)
        if max(config.aux_layer_ids) >= n:
            raise ValueError(f"aux_layer_ids {config.aux_layer_ids} exceed the target's {n} layers")
        return config

    def llama_config(self) -> LlamaConfig:
        """LlamaConfig of the drafter's decoder layers (hidden size d, L layers)."""
        cfg = LlamaConfig(
            **self.layer_config,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            vocab_size=self.target_vocab_size,
        )
        cfg._attn_implementation = "sdpa"
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": MODEL_TYPE,
            "format_version": FORMAT_VERSION,
            **dataclasses.asdict(self),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecBlockConfig:
        data = dict(data)
        if data.pop("model_type", None) != MODEL_TYPE:
            raise ValueError(f"model_type is not {MODEL_TYPE!r}")
        version = data.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise ValueError(f"format_version {version!r} is not {FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        return cls(**data)
