"""Configuration of a gated-LoRA MTP adapter, and the base-model dimensions it is built for.

Both are validated once, in ``__post_init__``, with messages that name the offending field, so a
bad ``adapter_config.json`` fails at load time instead of as a shape error deep in a forward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
KNOWN_MODULES = ATTN_MODULES + MLP_MODULES


class AdapterError(ValueError):
    """An adapter directory, file or config that cannot be used (the message names which)."""


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class BaseDims:
    """Shapes of the base model's linear layers that the adapter's LoRA factors must match."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    q_dim: int  # num_attention_heads * head_dim
    kv_dim: int  # num_key_value_heads * head_dim

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive_int(f"BaseDims.{f.name}", getattr(self, f.name))

    @classmethod
    def from_hf_config(cls, config: Any) -> BaseDims:
        """Dimensions of a Hugging Face Llama/Qwen3 config (``head_dim`` may be explicit)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            intermediate_size=config.intermediate_size,
            q_dim=heads * head_dim,
            kv_dim=kv_heads * head_dim,
        )

    def module_shape(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one target module."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        shapes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if module not in shapes:
            raise ValueError(f"unknown target module {module!r}; known: {', '.join(KNOWN_MODULES)}")
        return shapes[module]


@dataclass(frozen=True)
class MtpAdapterConfig:
    """Hyper-parameters of the adapter (paper §4.3: ``Y = XW + (g ⊙ X) A Bᵀ · alpha/rank``).

    ``mask_token_ids[j-1]`` is the vocabulary id fed at mask slot ``j`` (1..k_max); its base
    embedding is replaced by the adapter's ``mask_embeddings[j-1]``, so the ids only tag the slots.
    """

    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = KNOWN_MODULES
    k_max: int = 4
    base_model: str = ""
    mask_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _positive_int("MtpAdapterConfig.rank", self.rank)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float):
            raise ValueError(f"MtpAdapterConfig.alpha must be a number, got {self.alpha!r}")
        if not self.alpha > 0:
            raise ValueError(f"MtpAdapterConfig.alpha must be > 0, got {self.alpha!r}")
        _positive_int("MtpAdapterConfig.k_max", self.k_max)
        modules = tuple(self.target_modules)
        if not modules or len(set(modules)) != len(modules):
            raise ValueError(
                f"MtpAdapterConfig.target_modules must be non-empty and without repeats, got {modules!r}"
            )
        unknown = [m for m in modules if m not in KNOWN_MODULES]
        if unknown:
            raise ValueError(
                f"MtpAdapterConfig.target_modules has unknown modules {unknown}; known: {', '.join(KNOWN_MODULES)}"
            )
        object.__setattr__(self, "target_modules", modules)
        if not isinstance(self.base_model, str):
            raise ValueError(f"MtpAdapterConfig.base_model must be a str, got {self.base_model!r}")
        ids = tuple(self.mask_token_ids)
        if len(ids) != self.k_max:
            raise ValueError(
                f"MtpAdapterConfig.mask_token_ids must hold k_max={self.k_max} ids, got {list(ids)}"
            )
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(
                f"MtpAdapterConfig.mask_token_ids must be non-negative ints, got {list(ids)}"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"MtpAdapterConfig.mask_token_ids must be distinct, got {list(ids)}")
        object.__setattr__(self, "mask_token_ids", ids)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        d["mask_token_ids"] = list(self.mask_token_ids)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> MtpAdapterConfig:
        """Build from JSON data; unknown keys are refused (a typo must not become a default)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"MtpAdapterConfig has no field(s) {unknown}; known: {sorted(known)}")
        data = dict(data)
        for key in ("target_modules", "mask_token_ids"):
            if key in data:
                if not isinstance(data[key], list | tuple):
                    raise ValueError(f"MtpAdapterConfig.{key} must be a list, got {data[key]!r}")
                data[key] = tuple(data[key])
        return cls(**data)
